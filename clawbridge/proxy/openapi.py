"""The OpenAPI document, with the request bodies the routes read (they parse raw bodies themselves,
so FastAPI cannot see them): what `/openapi.json` serves (to a caller with a key) and what
`scripts/fuzz_api.py` generates requests from.

Invariants:
- Each body schema is the pydantic model the route validates with, so the document and the
  validation cannot drift.
- Every `{name}` in a path is a required string path parameter of every operation on that path
  (routes that serve one answer under several base URLs do not read them, so FastAPI would leave
  them out, and schema-driven clients refuse such an operation).
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from clawbridge.proxy.request import ChatRequest
from clawbridge.proxy.rl_routes import EndSession, SetReward, StartSession
from clawbridge.proxy.trajectory_routes import CompleteTrajectory, RegisterTrajectory
from clawbridge.shapes.anthropic import MessagesRequest
from clawbridge.shapes.responses import ResponsesRequest

REF = "#/components/schemas/{model}"


def body_models() -> list[tuple[str, type[BaseModel]]]:
    """(path suffix, model) for every POST route with a JSON body; first match wins."""
    return [
        ("/chat/completions", ChatRequest),
        ("/messages/count_tokens", MessagesRequest),
        ("/messages", MessagesRequest),
        ("/responses", ResponsesRequest),
        ("/register_trajectory", RegisterTrajectory),
        ("/complete_trajectory", CompleteTrajectory),
        ("/rl/start_session", StartSession),
        ("/rl/end_session", EndSession),
        ("/rl/set_reward", SetReward),
        ("/rl/set_session_reward", SetReward),
    ]


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document with `requestBody` filled in for JSON-body routes (cached on the app)."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas: dict[str, Any] = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, ops in doc.get("paths", {}).items():
        post = ops.get("post")
        if post is None:
            continue
        model = next((m for suffix, m in body_models() if path.endswith(suffix)), None)
        if model is None:
            continue
        schema = model.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        post["requestBody"] = {"required": True,
                               "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}
    for path, ops in doc.get("paths", {}).items():
        _declare_path_parameters(path, ops)
    app.openapi_schema = doc
    return doc


def _declare_path_parameters(path: str, ops: dict[str, Any]) -> None:
    """Add each `{name}` of `path` that an operation does not declare as a required string parameter."""
    names = re.findall(r"{([^{}/]+)}", path)
    for op in ops.values():
        params: list[dict[str, Any]] = op.setdefault("parameters", [])
        declared = {p.get("name") for p in params if p.get("in") == "path"}
        params.extend({"name": n, "in": "path", "required": True, "schema": {"type": "string", "title": n}}
                      for n in names if n not in declared)
