"""Test-only fault points: freeze the process at a named moment so a test can `kill -9` it there.

TEST-ONLY. Inert unless the environment variable `CLAWBRIDGE_TEST_FAULT` is set; nobody sets it
in production, and when it is unset a fault point costs one dictionary lookup.

    CLAWBRIDGE_TEST_FAULT=NAME[:N]          freeze at the N-th time point NAME is reached (N: 1)
    CLAWBRIDGE_TEST_FAULT_MARKER=PATH       written (JSON: name, pid) once the process is frozen
    CLAWBRIDGE_TEST_FAULT_HOLD_S=SECONDS    give up waiting for the kill after this long (600)

A frozen point never returns: the code after it does not run. The async form (`fault_point`)
only suspends its own task, so the proxy keeps serving (a test can still make calls while the
trainer is stuck mid-step); the sync form (`fault_point_sync`, for code in worker threads)
blocks its thread. A test waits for the marker file, then sends SIGKILL. If no kill comes within
the hold time, the process exits with status `EXIT_UNKILLED` (never silently carries on).

The named points (moments of one training step, see `clawbridge.trainer.loop`, and of promotion):
- `step.trained`: `train_step` returned (the optimizer ran); nothing published or committed.
- `publish.mid`: inside a backend's `publish`, the new weights reached the sampler/deployment
  but the backend's own bookkeeping (served version, manifest) is not done.
- `step.published`: `publish` returned; no checkpoint yet.
- `checkpoint.mid`: inside a backend's `save_checkpoint`, part of the checkpoint is written
  (local: the weights file of the not-yet-renamed directory; hosted: the state is saved on the
  service, not yet in the manifest).
- `step.checkpointed`: the checkpoint is written; the commit transaction has not run.
- `promotion.evaluated`: a candidate version is evaluated (or its canary test decided); its
  decision is not recorded (`clawbridge.promotion.promoter`).
- `promotion.decided`: the decision is committed; the router and the trainer have not acted on it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

FAULT_ENV = "CLAWBRIDGE_TEST_FAULT"
MARKER_ENV = "CLAWBRIDGE_TEST_FAULT_MARKER"
HOLD_ENV = "CLAWBRIDGE_TEST_FAULT_HOLD_S"
EXIT_UNKILLED = 75
"""Exit status of a process that reached its fault point and was not killed in time."""

POINTS = ("step.trained", "publish.mid", "step.published", "checkpoint.mid", "step.checkpointed",
          "promotion.evaluated", "promotion.decided")

_counts: dict[str, int] = {}
_lock = threading.Lock()


def _reached(name: str) -> float | None:
    """The hold time when this call is the armed one, else None (counts every call of `name`)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    target, _, nth = spec.partition(":")
    if target != name:
        return None
    with _lock:
        _counts[name] = _counts.get(name, 0) + 1
        if _counts[name] != (int(nth) if nth else 1):
            return None
    marker = os.environ.get(MARKER_ENV)
    print(f"clawbridge: test fault point {name!r} reached; frozen until killed (pid {os.getpid()})",
          file=sys.stderr, flush=True)
    if marker:
        tmp = Path(marker + ".tmp")
        tmp.write_text(json.dumps({"name": name, "pid": os.getpid()}))
        tmp.replace(marker)
    return float(os.environ.get(HOLD_ENV) or 600.0)


async def fault_point(name: str) -> None:
    """Freeze this task here when `CLAWBRIDGE_TEST_FAULT` names this point (see the module doc)."""
    hold = _reached(name)
    if hold is None:
        return
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    os._exit(EXIT_UNKILLED)


def fault_point_sync(name: str) -> None:
    """`fault_point` for code running in a worker thread: blocks the thread."""
    hold = _reached(name)
    if hold is None:
        return
    time.sleep(hold)
    os._exit(EXIT_UNKILLED)
