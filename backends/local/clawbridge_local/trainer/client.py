"""`FsdpTrainerClient`: the proxy-side handle on the trainer, in-process or a torchrun group.

Invariants:
- World size 1 with launcher `auto`/`inprocess` runs `TrainerCore` in this process (no torchrun,
  no process group); otherwise `torchrun --standalone` runs `world_size` worker ranks and the
  client talks to them through the file protocol in `protocol` (one request at a time).
- Across machines (`Nodes.count > 1`): this client's torchrun is node 0 (`--node-rank 0`,
  static rendezvous at `Nodes.master_addr:master_port`) with `world_size / count` ranks; each
  other node runs `python -m clawbridge_local.trainer.node --work-dir <work_dir> --node-rank K`,
  which reads `<work_dir>/current-run.json` (written before the group starts) and joins that run.
  Every rank reads requests and batches from the run dir, so `work_dir` must be on a filesystem
  every node mounts at the same path. A rank on another node leaves when its run is no longer
  the current one (closed, restarted, or replaced by a new start after a crash).
- Every method either returns or raises `TrainerError` within `config.step_timeout_s` (startup:
  `start_timeout_s`); a dead or stuck group is killed (whole process group) and reported with
  the failing rank's traceback and the log tail. After an error the client is stopped;
  `restart()` launches a fresh group and restores the last checkpoint this client saved/restored.
- Exports and checkpoints are written atomically by rank 0 (tmp dir + rename).
- Methods are blocking and not thread-safe; async callers wrap them in `asyncio.to_thread`.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from clawbridge.backend import Datum, LossConfig, StepResult
from clawbridge_local.trainer import protocol
from clawbridge_local.trainer.batch import validate_datum, write_batch
from clawbridge_local.trainer.config import TrainerConfig
from clawbridge_local.trainer.intact import check_intact
from clawbridge_local.trainer.protocol import TrainerError

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger("clawbridge.trainer.local")

Launcher = Literal["auto", "inprocess", "torchrun"]
RUN_FILE = "current-run.json"
"""In the work dir: the run other nodes join (`Nodes`); removed when the client closes."""


@dataclass(frozen=True)
class Nodes:
    """Where the trainer's ranks run: `count` machines, this one node 0."""

    count: int = 1
    master_addr: str = "127.0.0.1"
    """torchrun's `--master-addr`: node 0's address as the other nodes reach it."""
    master_port: int = 29500
    """torchrun's `--master-port` on node 0."""

    def ranks_per_node(self, world_size: int) -> int:
        if world_size % self.count:
            raise ValueError(f"world size {world_size} does not split over {self.count} nodes")
        return world_size // self.count


def torchrun_command(python: str, nproc: int, nodes: Nodes, node_rank: int, run_dir: Path,
                     client_pid: int) -> list[str]:
    """The torchrun command of one node of a run (node 0 with `--standalone` when alone)."""
    if nodes.count == 1:
        where = ["--standalone"]
    else:
        where = [f"--nnodes={nodes.count}", f"--node-rank={node_rank}", f"--master-addr={nodes.master_addr}",
                 f"--master-port={nodes.master_port}"]
    run_file = run_dir.parent / RUN_FILE
    return [
        python, "-m", "torch.distributed.run", *where, f"--nproc_per_node={nproc}",
        "--max_restarts=0", "--monitor_interval=0.2",
        "-m", "clawbridge_local.trainer.worker", "--run-dir", str(run_dir), "--client-pid", str(client_pid),
        *(["--run-file", str(run_file)] if nodes.count > 1 else []),
    ]  # fmt: skip


def worker_env(nproc: int, cpu_threads: int = 0) -> dict[str, str]:
    """The environment of a node's torchrun: `clawbridge_local` importable, threads split per rank."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    if cpu_threads > 0:
        env["OMP_NUM_THREADS"] = str(cpu_threads)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
"""The folder holding `clawbridge_local` (put on the workers' PYTHONPATH)."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What a restored checkpoint says about itself."""

    step: int
    """Optimizer steps taken when it was saved."""
    policy_version: int
    """The policy version the caller recorded with it."""


class FsdpTrainerClient:
    """Start, drive and stop the trainer; see the module docstring for the guarantees."""

    def __init__(
        self,
        config: TrainerConfig,
        work_dir: str | Path,
        *,
        launcher: Launcher = "auto",
        start_timeout_s: float = 600.0,
        python: str = sys.executable,
        nodes: Nodes | None = None,
        base_weights: Callable[[], nn.Module | None] | None = None,
    ) -> None:
        """`base_weights`: in-process LoRA only, the served base model (None: none lent) whose
        tensors the trainer's frozen weights are, instead of a copy of its own (`model.over_base`)."""
        self.config = config
        self.base_weights = base_weights
        self.work_dir = Path(work_dir)
        self.launcher: Launcher = launcher
        self.nodes = nodes or Nodes()
        """The machines the ranks run on (one unless set)."""
        self.start_timeout_s = start_timeout_s
        self.python = python
        self.world_size = 0
        self.step = 0
        """Optimizer steps the trainer has taken."""
        self.policy_version = 0
        """Recorded with checkpoints; the backend sets it when it publishes."""
        self.last_checkpoint: Path | None = None
        """Restored by `restart()`."""
        self.core: Any = None
        """In-process mode: the `TrainerCore` (the live model, e.g. for a torch engine)."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._run_dir: Path | None = None
        self._seq = 0
        self._runs = itertools.count(1)

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """Whether requests can be sent."""
        return self.core is not None or (self._proc is not None and self._proc.poll() is None)

    @property
    def in_process(self) -> bool:
        """Whether the trainer runs in this process."""
        return self.core is not None

    def start(self, world_size: int = 1) -> None:
        """Build the model (in-process) or launch `world_size` ranks and wait until ready."""
        if self.alive:
            raise TrainerError("trainer already started")
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.world_size = world_size
        if self.nodes.count > 1 and self.launcher == "inprocess":
            raise ValueError("more than one node needs the torchrun launcher")
        if world_size == 1 and self.nodes.count == 1 and self.launcher in ("auto", "inprocess"):
            from clawbridge_local.trainer.step import TrainerCore

            base = self.base_weights() if self.base_weights is not None and self.config.lora is not None else None
            self.core = TrainerCore(self.config, base=base)
            self.step = self.core.step
            if base is not None:
                served = {t.data_ptr() for t in base.parameters()}
                shared = sum(p.numel() * p.element_size() for p in set(self.core.model.parameters())
                             if p.data_ptr() in served)
                log.info("the trainer shares %.0f MiB of base weights with the engine", shared / 2**20)
            return
        if self.launcher == "inprocess":
            raise ValueError("the in-process launcher runs world size 1 only")
        self._launch(world_size)

    def _launch(self, world_size: int) -> None:
        nproc = self.nodes.ranks_per_node(world_size)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        run_dir = Path(tempfile.mkdtemp(prefix=f"run{next(self._runs)}-", dir=self.work_dir))
        protocol.init_run_dir(run_dir, self.config.to_json())
        cmd = torchrun_command(self.python, nproc, self.nodes, 0, run_dir, os.getpid())
        if self.nodes.count > 1:  # the run the other nodes join (`clawbridge_local.trainer.node`)
            protocol.write_json_atomic(self.work_dir / RUN_FILE, {
                "run_dir": str(run_dir), "nproc_per_node": nproc, "nnodes": self.nodes.count,
                "master_addr": self.nodes.master_addr, "master_port": self.nodes.master_port})
        log = open(run_dir / "torchrun.log", "wb")  # noqa: SIM115 - owned by the child
        self._proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=worker_env(nproc, self.config.cpu_threads),
            start_new_session=True,
        )
        log.close()
        self._run_dir, self._seq = run_dir, 0
        deadline = time.monotonic() + self.start_timeout_s
        while not protocol.ready_path(run_dir).exists():
            self._check_alive("while starting")
            if time.monotonic() > deadline:
                self._kill()
                waiting = (f"; node 0 waited for {self.nodes.count - 1} other node(s): run `python -m "
                           f"clawbridge_local.trainer.node --work-dir {self.work_dir} --node-rank K` on each"
                           if self.nodes.count > 1 else "")
                raise TrainerError(
                    f"trainer group not ready after {self.start_timeout_s:.0f}s{waiting}; log: {run_dir}"
                )
            time.sleep(0.05)
        self.step = int(json.loads(protocol.ready_path(run_dir).read_text())["step"])

    def restart(self) -> None:
        """Stop whatever runs, start a fresh trainer of the same world size, restore the last checkpoint."""
        world = self.world_size or 1
        self.close()
        self.start(world)
        if self.last_checkpoint is not None:
            self.restore_checkpoint(self.last_checkpoint)

    def close(self) -> None:
        """Shut the trainer down (politely, then by force)."""
        if self.core is not None:
            self.core = None
            return
        if self._proc is None:
            return
        if self._proc.poll() is None:
            try:
                self._request("shutdown", {}, timeout_s=30.0)
                self._proc.wait(timeout=30.0)
            except (TrainerError, subprocess.TimeoutExpired):
                pass
        self._kill()
        (self.work_dir / RUN_FILE).unlink(missing_ok=True)  # other nodes' ranks leave

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()

    # ---- requests ----------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path | None:
        """The current group's run directory (protocol files, log); None in-process."""
        return self._run_dir if self.core is None else None

    def _failure_text(self) -> str:
        assert self._run_dir is not None
        parts = []
        for rank in range(self.world_size):
            p = protocol.error_path(self._run_dir, rank)
            if p.exists():
                parts.append(f"rank {rank} failed:\n{p.read_text()[-3000:]}")
        log = self._run_dir / "torchrun.log"
        if not parts and log.exists():
            parts.append("log tail:\n" + log.read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    def _check_alive(self, when: str) -> None:
        if self._proc is None:
            raise TrainerError("trainer is not running; call start() or restart()")
        code = self._proc.poll()
        if code is not None:
            detail = self._failure_text()
            self._kill()
            raise TrainerError(f"trainer group exited (code {code}) {when}; {detail}")

    def _request(self, op: str, args: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        if self.core is not None:
            raise AssertionError("in-process mode does not use requests")
        self._check_alive(f"before {op}")
        assert self._run_dir is not None
        self._seq += 1
        seq = self._seq
        protocol.write_json_atomic(
            protocol.request_path(self._run_dir, seq), {"seq": seq, "op": op, "args": args}
        )
        resp_path = protocol.response_path(self._run_dir, seq)
        deadline = time.monotonic() + (timeout_s or self.config.step_timeout_s)
        delay = 0.002
        while not resp_path.exists():
            self._check_alive(f"during {op} (request {seq})")
            if time.monotonic() > deadline:
                self._kill()
                raise TrainerError(f"trainer did not answer {op} (request {seq}) in time; group killed")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.05)
        resp: dict[str, Any] = json.loads(resp_path.read_text())
        if not resp["ok"]:
            detail = self._failure_text()
            self._kill()
            raise TrainerError(f"trainer failed {op}: {resp['error']}\n{detail}")
        result: dict[str, Any] = resp["result"]
        return result

    def _call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """Run `op` in-process (errors wrapped as TrainerError) or through the group."""
        if self.core is None:
            return self._request(op, args)
        from clawbridge_local.trainer.worker import dispatch

        try:
            return dispatch(self.core, self.work_dir, {"seq": 0, "op": op, "args": args})
        except Exception as exc:
            raise TrainerError(f"trainer failed {op}: {type(exc).__name__}: {exc}") from exc

    def train_step(self, batch: Sequence[Datum], loss: LossConfig) -> StepResult:
        """One optimizer step on `batch` with the token-sum `loss`; raises TrainerError on failure."""
        if not batch:
            raise ValueError("train_step needs at least one datum")
        for d in batch:
            validate_datum(d)
        if self.core is not None:
            try:
                metrics = self.core.train_step(list(batch), loss)
            except Exception as exc:
                raise TrainerError(f"train step failed: {type(exc).__name__}: {exc}") from exc
        else:
            self._check_alive("before train_step")
            assert self._run_dir is not None
            write_batch(protocol.batch_path(self._run_dir, self._seq + 1), batch)
            metrics = self._request("train_step", {"loss": asdict(loss)})["metrics"]
        self.step = int(metrics["step"])
        return StepResult(metrics={k: float(v) for k, v in metrics.items()})

    def export_weights(self, out_dir: str | Path, name: str | None = None) -> Path:
        """Write the current weights to `out_dir/name` (default `step-<step>`) atomically.

        Full fine-tuning: a transformers folder (config + safetensors + tokenizer files).
        LoRA: a peft adapter folder (adapter_config.json + adapter_model.safetensors).
        """
        out = Path(out_dir).resolve()
        result = self._call("export", {"out_dir": str(out), "name": name or f"step-{self.step:08d}"})
        return Path(result["path"])

    def save_checkpoint(self, path: str | Path, policy_version: int | None = None) -> Path:
        """Weights (or adapter) + optimizer + step + policy version in `path`, atomically."""
        version = self.policy_version if policy_version is None else policy_version
        target = Path(path).resolve()
        self._call("save_checkpoint", {"path": str(target), "policy_version": version})
        self.last_checkpoint = target
        return target

    def restore_checkpoint(self, path: str | Path) -> CheckpointInfo:
        """Load a checkpoint written by any world size; sets `step` and `policy_version`. Raises
        `clawbridge.backend.CheckpointDamaged` (nothing loaded) when its files are torn."""
        target = Path(path).resolve()
        check_intact(target)  # CheckpointDamaged (a file missing or cut short) before any rank loads half of it
        info = self._call("restore_checkpoint", {"path": str(target)})
        self.step, self.policy_version = int(info["step"]), int(info["policy_version"])
        self.last_checkpoint = target
        return CheckpointInfo(step=self.step, policy_version=self.policy_version)
