"""The worker rank entry point: `python -m torch.distributed.run ... -m clawbridge_local.trainer.worker`.

Invariants:
- Every rank builds a `TrainerCore(distributed=True)` from `<run-dir>/config.json`, then polls
  the request files in sequence order (see `protocol`), so all ranks run the same collectives in
  the same order without any idle collective (no process-group timeout while nobody trains).
- Rank 0 alone writes `ready.json`, responses and exported files; any exception is fatal.
- Process group backend: NCCL when CUDA is available, else gloo.
- A rank stops waiting for requests when the client's process is gone (`--client-pid`, on the
  client's machine) or, on another node, when `--run-file` no longer names its run dir.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from clawbridge.backend import LossConfig
from clawbridge_local.trainer import protocol
from clawbridge_local.trainer.batch import read_batch
from clawbridge_local.trainer.config import TrainerConfig
from clawbridge_local.trainer.step import TrainerCore


def _client_alive(pid: int) -> bool:
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _current_run(run_file: Path | None, run_dir: Path) -> bool:
    """Whether `run_file` (the client's `current-run.json`; None: not checked) still names `run_dir`."""
    if run_file is None:
        return True
    import json

    try:
        return Path(json.loads(run_file.read_text())["run_dir"]) == run_dir
    except (OSError, ValueError, KeyError):
        return False


def _wait_request(run_dir: Path, seq: int, client_pid: int, run_file: Path | None = None) -> dict[str, Any] | None:
    """The next request, or None when the client went away (or, on another node, the run ended)."""
    path = protocol.request_path(run_dir, seq)
    delay, last_check = 0.002, time.monotonic()
    while not path.exists():
        time.sleep(delay)
        delay = min(delay * 1.5, 0.05)
        if time.monotonic() - last_check > 1.0:
            last_check = time.monotonic()
            if not _client_alive(client_pid) or not _current_run(run_file, run_dir):
                return None
    import json

    req: dict[str, Any] = json.loads(path.read_text())
    return req


def dispatch(core: TrainerCore, run_dir: Path, req: dict[str, Any]) -> dict[str, Any]:
    """Run one request on this rank; the result is what rank 0 answers."""
    op, args = req["op"], req.get("args", {})
    if op == "train_step":
        batch = read_batch(protocol.batch_path(run_dir, int(req["seq"])))
        return {"metrics": core.train_step(batch, LossConfig(**args["loss"]))}
    if op == "export":
        return {"path": str(core.export(Path(args["out_dir"]), args["name"]))}
    if op == "save_checkpoint":
        return {"path": str(core.save_checkpoint(Path(args["path"]), int(args["policy_version"])))}
    if op == "restore_checkpoint":
        return core.restore_checkpoint(Path(args["path"]))
    if op == "shutdown":
        return {}
    raise ValueError(f"unknown op {op!r}; expected one of {protocol.OPS}")


def main(argv: list[str] | None = None) -> int:
    """Serve requests until `shutdown` or until the client disappears."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--client-pid", type=int, default=0)
    parser.add_argument("--run-file", type=Path, help="another node's ranks: leave once this stops naming the run")
    ns = parser.parse_args(argv)
    run_dir: Path = ns.run_dir
    rank, world, local_rank = (
        int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0))
    )
    protocol.pid_path(run_dir, rank).write_text(str(os.getpid()))
    try:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=30))
        config = TrainerConfig.from_json((run_dir / "config.json").read_text())
        core = TrainerCore(config, distributed=True, rank=rank, world_size=world, local_rank=local_rank)
        dist.barrier()
        if rank == 0:
            protocol.write_json_atomic(protocol.ready_path(run_dir), {"world_size": world, "step": core.step})
        seq = 1
        while True:
            req = _wait_request(run_dir, seq, ns.client_pid, ns.run_file)
            if req is None:
                break
            result = dispatch(core, run_dir, req)
            if rank == 0:
                protocol.write_json_atomic(
                    protocol.response_path(run_dir, seq), {"seq": seq, "ok": True, "result": result}
                )
            if req["op"] == "shutdown":
                break
            seq += 1
    except BaseException as exc:
        tb = traceback.format_exc()
        protocol.error_path(run_dir, rank).write_text(tb)
        if rank == 0 and "seq" in locals():
            err = {"seq": seq, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
            protocol.write_json_atomic(protocol.response_path(run_dir, seq), err)
        print(tb, file=sys.stderr, flush=True)
        os._exit(1)  # do not wait on collectives other ranks will never join
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
