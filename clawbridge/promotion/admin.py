"""The admin's actions on the shared policy's gate: `clawbridge promote N`, `rollback N`, `resume`.

Invariants:
- An action takes effect under the trainer's lock, so no step or pending decision runs meanwhile,
  and is recorded as a decision only once it took effect: `PromotionError` (404) when the version
  cannot serve, `CheckpointUnavailable` (409) when the backend could not load its checkpoint;
  either way nothing changed (the serving version, the router and the store are as before).
- A rollback holds training (`PromotionStore.release_hold`) until `resume`; the hold lives in the
  store, so it survives a restart, and the promoter's `settle` reads it before anything else.
- The trainer goes on from the version that now serves: a rollback version of its committed state
  (weights and optimizer) when it holds other weights.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from clawbridge.access import OPERATOR
from clawbridge.promotion.promoter import (
    HELD_PREFIX,
    CheckpointUnavailable,
    Promoter,
    PromotionError,
    held_words,
)
from clawbridge.serving.versions import VersionNotFound
from clawbridge.store.promotion import Decision

if TYPE_CHECKING:
    from clawbridge.trainer.checkpoints import CheckpointKeeper
    from clawbridge.trainer.loop import TrainerLoop

log = logging.getLogger("clawbridge.promotion")

async def set_serving(p: Promoter, version: int, action: str, trainer: TrainerLoop | None) -> dict[str, Any]:
    """`clawbridge promote N` / `rollback N`: `version` serves from now on and the trainer goes on
    from it; a rollback also holds training until `resume` (module invariants)."""
    if trainer is None:
        return await _set_serving(p, version, action, None)
    async with trainer.lock:
        return await _set_serving(p, version, action, trainer.keeper)


async def _set_serving(p: Promoter, version: int, action: str, keeper: CheckpointKeeper | None) -> dict[str, Any]:
    from clawbridge.trainer.checkpoints import NoCheckpoint, no_checkpoint_message

    if not await p.servable(version):
        row = await asyncio.to_thread(p.versions.get, version)
        raise PromotionError(no_checkpoint_message(version, row))
    previous = p.serving if p.mode != "off" else p.router.serving_version
    if (p.mode != "off" and p.pinned) or keeper is None:  # served beside the published version
        try:
            await p.router.sampler_for(version, OPERATOR, "serve")
        except VersionNotFound as exc:
            raise PromotionError(str(exc)) from None
    resumed: int | None = None
    if keeper is not None and await asyncio.to_thread(p.weights_of, p.router.published_version) != \
            await asyncio.to_thread(p.weights_of, version):
        try:
            resumed = await keeper.rollback(version)
        except NoCheckpoint as exc:
            raise PromotionError(str(exc)) from None
        except Exception as exc:
            log.error("promotion: %s to v%d failed, nothing changed: %s", action, version, exc)
            raise CheckpointUnavailable(
                f"the {p.router.backend.name} backend could not load policy version {version}'s checkpoint "
                f"({type(exc).__name__}: {exc}); nothing changed: v{previous} still serves") from None
    hold = action == "rollback"
    reason = f"{action} by the admin (serving was v{previous})"
    if hold:
        reason += "; training holds until `clawbridge resume`"
    d = Decision(version, "promoted", "admin", reason, previous)
    await asyncio.to_thread(p.pstore.decide, d, p.mode, hold)
    p.router.set_candidate(None)
    p.canary = None
    p.hold = held_words(version) if hold else None
    p.serving = version
    if p.mode == "off":
        p.router.set_serving(None if keeper is not None else version)
        p.serving = p.router.serving_version
        await asyncio.to_thread(p.pstore.set_state, "off", p.serving)
    else:
        p.router.set_serving(version if p.pinned else None)
    log.warning("promotion: %s to v%d by the admin (was v%d)%s%s", action, version, previous,
                f"; the trainer resumes from it as v{resumed}" if resumed is not None else "",
                "; training holds until `clawbridge resume`" if hold else "")
    return {"serving_version": p.serving, "previous": previous, "trainer_version": resumed, "held": hold}


async def resume(p: Promoter) -> dict[str, Any]:
    """`clawbridge resume`: end the hold of an admin's rollback, so training goes on from the
    serving version (later versions are gated as the mode says)."""
    held = await asyncio.to_thread(p.pstore.release_hold)
    if p.hold is not None and p.hold.startswith(HELD_PREFIX):
        p.hold = None
    log.warning("promotion: training resumed by the admin%s", f" (v{held} was held)" if held is not None else
                " (nothing was held)")
    return {"resumed": held is not None, "held_version": held,
            "serving_version": p.serving if p.mode != "off" else p.router.serving_version}
