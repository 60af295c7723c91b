"""The file protocol between `FsdpTrainerClient` (in the proxy process) and the worker group.

Layout of one run directory (a fresh one per launch of the group):

    config.json              TrainerConfig, written by the client before launch
    ready.json               rank 0, once every rank has built its model: {"world_size", "step"}
    req/00000001.json        a request {"seq", "op", "args"}; op in OPS
    req/00000001.batch.json  the batch of a train_step (JSON datums), written before its request
    resp/00000001.json       rank 0's answer {"seq", "ok", "result"} or {"seq", "ok": false, "error"}
    rank<r>.pid              process id of rank r (for operators and fault-injection tests)
    rank<r>.error.txt        traceback of a rank that failed (it then exits non-zero)
    torchrun.log             stdout + stderr of the whole group

Invariants:
- Every file a reader polls for appears atomically (written to a dot-tmp name, then os.replace),
  so a reader never sees a partial request, response or ready marker.
- Requests are numbered 1, 2, 3, ... and every rank executes every request in that order; the
  client sends the next one only after the previous response (one request in flight).
- Any failure inside a rank is fatal for the group: the rank writes rank<r>.error.txt (rank 0
  also an error response) and exits; torchrun then stops the other ranks. The client turns a
  dead group, an error response or a timeout into `TrainerError` and never waits forever.
- Workers exit by themselves when the client process disappears (no orphaned groups).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clawbridge.runtime.durable import write_atomic

OPS = ("train_step", "export", "save_checkpoint", "restore_checkpoint", "shutdown")
"""Operations a request may name."""


class TrainerError(RuntimeError):
    """A request failed, the group died, or it did not answer in time; the step did not happen."""


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to `path` so that readers see either nothing or the whole file
    (`clawbridge.runtime.durable.write_atomic`)."""
    write_atomic(path, json.dumps(obj), mode=0o644)


def request_path(run_dir: Path, seq: int) -> Path:
    """Where request `seq` is written."""
    return run_dir / "req" / f"{seq:08d}.json"


def batch_path(run_dir: Path, seq: int) -> Path:
    """Where the batch of request `seq` is written."""
    return run_dir / "req" / f"{seq:08d}.batch.json"


def response_path(run_dir: Path, seq: int) -> Path:
    """Where rank 0 answers request `seq`."""
    return run_dir / "resp" / f"{seq:08d}.json"


def ready_path(run_dir: Path) -> Path:
    """Marker rank 0 writes once the group can take requests."""
    return run_dir / "ready.json"


def pid_path(run_dir: Path, rank: int) -> Path:
    """Process id of rank `rank`."""
    return run_dir / f"rank{rank}.pid"


def error_path(run_dir: Path, rank: int) -> Path:
    """Traceback of a failed rank."""
    return run_dir / f"rank{rank}.error.txt"


def init_run_dir(run_dir: Path, config_json: str) -> None:
    """Create the layout and write the config (client side, before launch)."""
    (run_dir / "req").mkdir(parents=True, exist_ok=True)
    (run_dir / "resp").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(config_json)
