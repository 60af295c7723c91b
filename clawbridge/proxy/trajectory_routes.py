"""Claw-R1's gateway trajectory endpoints, over clawbridge sessions.

A Claw-R1 black-box agent is given `base_url = http://host:port/{trajectory_uid}/{prompt_uid}/v1`;
its model calls there are recorded in session `trajectory_uid` with task id `prompt_uid` (see
`model_routes`). Around them its agent flow calls:

- POST /init_trajectory -> {trajectory_uid, base_url}          a new trajectory (session), prompt uid "1"
- POST /{t}/{p}/v1/register_trajectory {channel?, metadata?}    creates the session; `channel` must be "train"
- POST /{t}/{p}/v1/complete_trajectory {reward?, channel?}      the reward for the whole session, then its end

These are management calls, so they need the admin key (the agent's model calls need the client
key). Claw-R1's white-box endpoints (`/generate`, `/submit_steps`, `/compute_reward`) answer 404
naming the clawbridge equivalent.

Invariant: a reward is accepted (200) only after it is committed; a trajectory is a session with
source `trajectory`, so everything that works on sessions (`/rl/sessions/{id}`, the trainer's
group baseline over the task id) works on it.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from clawbridge.proxy.errors import ApiError, validated
from clawbridge.proxy.model_routes import TRAJECTORY_SOURCE
from clawbridge.proxy.ownership import caller
from clawbridge.proxy.request import parse_json_object, read_body
from clawbridge.proxy.sessions import check_session_id
from clawbridge.proxy.state import ProxyState
from clawbridge.store import new_id

log = logging.getLogger("clawbridge.proxy")

DEFAULT_PROMPT_UID = "1"
"""The prompt uid Claw-R1's gateway puts in the base URL it hands out."""

_WHITE_BOX = {
    "generate": "clawbridge samples through /v1/chat/completions (recorded token-exactly); "
                "send the chat request there",
    "submit_steps": "clawbridge records every model call itself; there are no steps to submit",
    "compute_reward": "send rewards with POST /rl/set_reward, or configure a judge (see docs/rewards.md)",
}


class RegisterTrajectory(BaseModel):
    model_config = ConfigDict(extra="ignore")
    channel: str = "train"
    metadata: dict[str, Any] | None = None


class CompleteTrajectory(BaseModel):
    model_config = ConfigDict(extra="ignore")
    reward: float | None = None
    channel: str = "train"


def _check_channel(channel: str) -> None:
    if channel != "train":
        raise ApiError(400, f"channel {channel[:40]!r} is not served: clawbridge keeps one pool and trains on "
                       "every rewarded session; send evaluation calls with 'X-Turn-Type: side' (recorded, "
                       "never trained)", param="channel", code="unsupported_channel")


def build_trajectory_router(state: ProxyState) -> APIRouter:
    router = APIRouter()

    async def body_of(request: Request, model: type[BaseModel]) -> Any:
        raw = await read_body(request, state.settings.max_body_bytes, state.settings.body_timeout_s)
        data = parse_json_object(raw) if raw.strip() else {}
        return validated(model, data)

    def ids(trajectory_uid: str, prompt_uid: str) -> str:
        check_session_id(prompt_uid, "prompt uid in the URL")
        return check_session_id(trajectory_uid, "trajectory uid in the URL")

    @router.post("/init_trajectory")
    async def init_trajectory(request: Request) -> dict[str, Any]:
        await caller(state, request, "trajectories", "write")
        trajectory = new_id("traj")
        await state.writer.call(state.store.ensure_session, trajectory, TRAJECTORY_SOURCE, DEFAULT_PROMPT_UID)
        base = str(request.base_url).rstrip("/")
        return {"trajectory_uid": trajectory, "base_url": f"{base}/{trajectory}/{DEFAULT_PROMPT_UID}/v1"}

    @router.post("/{trajectory_uid}/{prompt_uid}/v1/register_trajectory")
    async def register_trajectory(request: Request, trajectory_uid: str, prompt_uid: str) -> dict[str, Any]:
        await caller(state, request, "trajectories", "write")
        sid = ids(trajectory_uid, prompt_uid)
        req: RegisterTrajectory = await body_of(request, RegisterTrajectory)
        _check_channel(req.channel)
        await state.writer.call(state.store.ensure_session, sid, TRAJECTORY_SOURCE, prompt_uid)
        return {"status": "ok", "session_id": sid}

    @router.post("/{trajectory_uid}/{prompt_uid}/v1/complete_trajectory")
    async def complete_trajectory(request: Request, trajectory_uid: str, prompt_uid: str) -> dict[str, Any]:
        await caller(state, request, "trajectories", "write")
        sid = ids(trajectory_uid, prompt_uid)
        req: CompleteTrajectory = await body_of(request, CompleteTrajectory)
        _check_channel(req.channel)
        if await state.read(state.store.get_session, sid) is None:
            raise ApiError(404, f"unknown trajectory {sid!r}", code="session_not_found")
        if req.reward is not None:
            if not math.isfinite(req.reward):
                raise ApiError(422, "reward must be a finite number", param="reward")
            await state.writer.call(state.store.add_reward, sid, req.reward, "api", None)
        ended = await state.end_session(sid)
        return {"status": "ok", "session_id": sid, "ended": ended}

    for name, why in _WHITE_BOX.items():
        router.add_api_route(f"/{name}", _not_served(f"Claw-R1's /{name} is not served: {why}"), methods=["POST"])

    return router


def _not_served(message: str) -> Any:
    async def not_served() -> None:
        raise ApiError(404, message, code="not_served")

    return not_served
