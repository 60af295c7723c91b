"""The promotion API (admin key): what serves, decisions, evaluations, promote and roll back.

- GET  /rl/promotion -> the `promotion` object of `/rl/status`
- POST /rl/promote {"version": N} -> {"serving_version": N, "previous", "trainer_version"}
- POST /rl/rollback {"version": N} -> the same, and "held": true (N serves; training goes on from
      it only after /rl/resume)
- POST /rl/resume {} -> {"resumed", "held_version", "serving_version"}: training goes on
- POST /rl/promote|rollback {"version": N, "user": "alice"} -> {"user", "serving_version", "previous",
  "trainer_version"}: N, a version of alice's own adapter, answers her calls from now on (under a new
  version of her lane) and her lane trains on from it
- POST /rl/eval {"versions": [0, 5, "latest", "serving"]?, "eval_set": "<JSONL text>"?}
      -> {"eval_set", "digest", "results": [{version, items, passed, pass_rate, ci_low, ci_high,
          score, mean_judge_score, mean_answer_tokens, seconds, failed}]}

Invariants: a version that does not exist or whose checkpoint was pruned is 404
`model_not_found` naming why; a checkpoint the backend could not load is 409
`checkpoint_unavailable` (nothing changed, no decision recorded); a bad eval set line is 400
`invalid_eval_set` naming the line;
promote/rollback are answered once the decision is committed (and the trainer reloaded). Lanes
never cross (`clawbridge.access`, `versions` x `serve`): a version of a user's adapter is served
only to that user and only when the admin names her lane (`"user"`), a shared version never
with one: 403 `version_of_another_lane` otherwise. The dashboard's buttons call the same
functions (`set_serving`, `run_eval`).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, ValidationError

from clawbridge.access import Principal, Target
from clawbridge.promotion import admin
from clawbridge.promotion.evalset import EvalSetError, parse_eval_set
from clawbridge.promotion.promoter import Promoter, PromotionError
from clawbridge.promotion.report import promotion_status
from clawbridge.proxy.errors import ApiError
from clawbridge.proxy.ownership import caller, require
from clawbridge.proxy.request import parse_json_object, read_body
from clawbridge.proxy.state import ProxyState
from clawbridge.serving.versions import VersionNotFound
from clawbridge.store.users import UserError, check_user_name
from clawbridge.store.versions import VersionStore
from clawbridge.trainer.checkpoints import NoCheckpoint

log = logging.getLogger("clawbridge.proxy")

MAX_EVAL_VERSIONS = 20


class VersionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int
    user: str | None = None
    """The lane: a version of this user's own adapter, served to their calls (None: the shared policy)."""


class EvalBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    versions: list[int | str] | None = None
    eval_set: str | None = None


def promoter_of(state: ProxyState) -> Promoter:
    if state.promotion is None:  # build_state always sets it; an app built by hand may not
        raise ApiError(503, "promotion is not set up on this server", code="promotion_unavailable")
    return state.promotion


def version_body(body: dict[str, Any]) -> VersionBody:
    try:
        req = VersionBody.model_validate(body)
    except ValidationError:
        raise ApiError(422, "send {\"version\": <a committed policy version>, \"user\": <her lane, optional>}",
                       param="version") from None
    if req.user is not None:
        try:
            check_user_name(req.user)
        except UserError as exc:
            raise ApiError(422, str(exc), param="user", code="invalid_user") from None
    return req


async def set_serving(state: ProxyState, by: Principal, req: VersionBody, action: str) -> dict[str, Any]:
    """`req.version` serves from now on, in the lane `req.user` names (None: the shared policy,
    `admin.set_serving`; a user: `UserLanes.rollback`), as an HTTP answer or error."""
    version = req.version

    def missing() -> ApiError:
        return ApiError(404, f"policy version {version} does not exist", code="model_not_found", param="version")

    row = await state.read(VersionStore(state.store).find, version)
    if row is not None:
        require(by.in_lane(req.user), "versions", "serve", Target(row.lane or None, version=version), missing)
    if req.user is None:
        try:
            return await admin.set_serving(promoter_of(state), version, action, state.trainer)
        except PromotionError as exc:
            raise ApiError(exc.status, str(exc), code=exc.code, param="version") from None
    if row is None:
        raise missing()
    if state.lanes is None:
        raise ApiError(409, "per-user adapters are not trained on this server (per_user_adapters off, or "
                       "--no-train); stop it and run `clawbridge rollback N --user USER`", code="lanes_not_running")
    try:
        previous, new = await state.lanes.rollback(req.user, version)
    except LookupError as exc:
        raise ApiError(409, str(exc), code="lanes_not_running") from None
    except NoCheckpoint as exc:
        raise ApiError(404, str(exc), code="model_not_found", param="version") from None
    log.warning("%s: user %s's calls get v%d now (v%d's adapter; was %s) by the admin", action, req.user, new,
                version, f"v{previous}" if previous is not None else "the shared policy")
    return {"user": req.user, "serving_version": new, "previous": previous, "trainer_version": new}


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

    async def body_of(request: Request) -> dict[str, Any]:
        return parse_json_object(await read_body(request, state.settings.max_body_bytes, state.settings.body_timeout_s))

    @router.get("/promotion")
    async def promotion(request: Request) -> dict[str, Any]:
        await caller(state, request, "status", "read")
        return dict(await state.read(promotion_status, promoter_of(state)))

    @router.post("/promote")
    async def promote(request: Request) -> dict[str, Any]:
        by = await caller(state, request, "versions", "serve")
        return await set_serving(state, by, version_body(await body_of(request)), "promote")

    @router.post("/rollback")
    async def rollback(request: Request) -> dict[str, Any]:
        by = await caller(state, request, "versions", "serve")
        return await set_serving(state, by, version_body(await body_of(request)), "rollback")

    @router.post("/resume")
    async def resume(request: Request) -> dict[str, Any]:
        await caller(state, request, "versions", "serve")  # ends an admin's rollback hold
        return await admin.resume(promoter_of(state))

    @router.post("/eval")
    async def evaluate(request: Request) -> dict[str, Any]:
        await caller(state, request, "versions", "evaluate")
        body = await body_of(request)
        try:
            req = EvalBody.model_validate(body)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise ApiError(422, f"invalid field {loc}: {err['msg']}", param=loc) from None
        return await run_eval(state, resolve_versions(state, req.versions), req.eval_set)

    return router
