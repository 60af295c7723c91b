"""The promotion API (admin key): what serves, decisions, evaluations, promote and roll back.

- GET  /rl/promotion -> the `promotion` object of `/rl/status`
- POST /rl/promote {"version": N} -> {"serving_version": N, "previous", "trainer_version"}
- POST /rl/rollback {"version": N} -> the same, and "held": true (N serves; training goes on from
      it only after /rl/resume)
- POST /rl/resume {} -> {"resumed", "held_version", "serving_version"}: training goes on
- POST /rl/eval {"versions": [0, 5, "latest", "serving"]?, "eval_set": "<JSONL text>"?}
      -> {"eval_set", "digest", "results": [{version, items, passed, pass_rate, ci_low, ci_high,
          score, mean_judge_score, mean_answer_tokens, seconds, failed}]}

Invariants: a version that does not exist or whose checkpoint was pruned is 404
`model_not_found` naming why; a checkpoint the backend could not load is 409
`checkpoint_unavailable` (nothing changed, no decision recorded); a bad eval set line is 400 `invalid_eval_set` naming the line;
promote/rollback are answered once the decision is committed (and the trainer reloaded). The
dashboard's buttons call the same functions (`set_serving`, `run_eval`).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, ValidationError

from clawbridge.promotion.evalset import EvalSetError, parse_eval_set
from clawbridge.promotion.promoter import Promoter, PromotionError
from clawbridge.proxy.auth import authenticate, require_admin
from clawbridge.proxy.errors import ApiError
from clawbridge.proxy.request import parse_json_object, read_body
from clawbridge.proxy.state import ProxyState
from clawbridge.versions import VersionNotFound

log = logging.getLogger("clawbridge.proxy")

MAX_EVAL_VERSIONS = 20


class VersionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int


class EvalBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    versions: list[int | str] | None = None
    eval_set: str | None = None


def promoter_of(state: ProxyState) -> Promoter:
    if state.promotion is None:  # build_state always sets it; an app built by hand may not
        raise ApiError(503, "promotion is not set up on this server", code="promotion_unavailable")
    return state.promotion


async def set_serving(state: ProxyState, version: int, action: str) -> dict[str, Any]:
    """`version` serves from now on (`Promoter.set_serving`), as an HTTP answer or error."""
    try:
        return await promoter_of(state).set_serving(version, action, state.trainer)
    except PromotionError as exc:
        raise ApiError(exc.status, str(exc), code=exc.code, param="version") from None


def resolve_versions(state: ProxyState, asked: list[int | str] | None) -> list[int]:
    """Version numbers for `asked` ("latest": the newest the trainer published; "serving")."""
    promoter = promoter_of(state)
    out: list[int] = []
    for v in asked or ["serving", "latest"]:
        if isinstance(v, int):
            n = v
        elif v == "latest":
            n = state.router.published_version
        elif v == "serving":
            n = promoter.serving if promoter.mode != "off" else state.router.serving_version
        elif v.isdigit():
            n = int(v)
        else:
            raise ApiError(422, f"versions: {v!r} is not a version number, 'latest' or 'serving'", param="versions")
        if n not in out:
            out.append(n)
    if not 1 <= len(out) <= MAX_EVAL_VERSIONS:
        raise ApiError(422, f"versions: give 1 to {MAX_EVAL_VERSIONS} versions", param="versions")
    return out


async def run_eval(state: ProxyState, versions: list[int], text: str | None) -> dict[str, Any]:
    """Evaluate each of `versions` on the JSONL `text` (default: the server's eval set)."""
    promoter = promoter_of(state)
    try:
        es = (parse_eval_set(text, "the posted eval set", state.settings.eval_max_tokens) if text is not None
              else await state.read(promoter.eval_set))
    except EvalSetError as exc:
        raise ApiError(400, str(exc), code="invalid_eval_set", param="eval_set") from None
    if not es.items:
        raise ApiError(400, "no evaluation set: set eval_set (or post one), or let held-out sessions collect "
                       "verdicts (promotion_mode eval)", code="invalid_eval_set", param="eval_set")
    results = []
    for v in versions:
        try:
            results.append((await promoter.evaluate(v, es)).as_dict())
        except VersionNotFound as exc:
            kept = ", ".join(str(k) for k in exc.kept) or "none"
            raise ApiError(404, f"{exc}; versions kept: {kept}", code="model_not_found", param="versions") from None
        except EvalSetError as exc:
            raise ApiError(400, str(exc), code="invalid_eval_set", param="eval_set") from None
    return {"eval_set": es.source, "digest": es.digest, "items": len(es.items), "results": results}


def build_promotion_router(state: ProxyState) -> APIRouter:
    router = APIRouter(prefix="/rl")

    async def admin_body(request: Request) -> dict[str, Any]:
        require_admin(await authenticate(request, state.keys, state.store))
        return parse_json_object(await read_body(request, state.settings.max_body_bytes, state.settings.body_timeout_s))

    def version_of(body: dict[str, Any]) -> int:
        try:
            return VersionBody.model_validate(body).version
        except ValidationError:
            raise ApiError(422, "send {\"version\": <a committed policy version>}", param="version") from None

    @router.get("/promotion")
    async def promotion(request: Request) -> dict[str, Any]:
        require_admin(await authenticate(request, state.keys, state.store))
        return dict(await state.read(promoter_of(state).status))

    @router.post("/promote")
    async def promote(request: Request) -> dict[str, Any]:
        return await set_serving(state, version_of(await admin_body(request)), "promote")

    @router.post("/rollback")
    async def rollback(request: Request) -> dict[str, Any]:
        return await set_serving(state, version_of(await admin_body(request)), "rollback")

    @router.post("/resume")
    async def resume(request: Request) -> dict[str, Any]:
        require_admin(await authenticate(request, state.keys, state.store))
        return await promoter_of(state).resume()

    @router.post("/eval")
    async def evaluate(request: Request) -> dict[str, Any]:
        body = await admin_body(request)
        try:
            req = EvalBody.model_validate(body)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise ApiError(422, f"invalid field {loc}: {err['msg']}", param=loc) from None
        return await run_eval(state, resolve_versions(state, req.versions), req.eval_set)

    return router
