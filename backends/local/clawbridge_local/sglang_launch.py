"""`SGLangServer`: launches `python -m sglang.launch_server`, health-checks it, stops it by pid.

Invariants:
- The server binds 127.0.0.1 only; its output goes to a log file in the state dir.
- `start()` returns only once `/health_generate` answers 200 (a real one-token generation in SGLang),
  within `startup_timeout_s`, polling at most every `poll_s`; a server that exits or never becomes
  healthy is stopped and reported with the tail of its log.
- The child runs in its own session (process group), so `stop()` reaches SGLang's scheduler and
  detokenizer subprocesses too: SIGTERM to that group, SIGKILL after `stop_timeout_s`.
- `command` replaces `python -m sglang.launch_server` (tests run a fake under the same arguments).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

DEFAULT_COMMAND: tuple[str, ...] = (sys.executable, "-m", "sglang.launch_server")


@dataclass(frozen=True)
class SGLangLaunchConfig:
    """The `launch_server` arguments clawbridge sets."""

    model_path: str
    port: int
    lora_rank: int = 0
    """> 0: `--enable-lora --max-lora-rank R --lora-target-modules ...` (adapters are loaded later)."""
    lora_target_modules: tuple[str, ...] = ()
    tp_size: int = 1
    dp_size: int = 1
    mem_fraction: float = 0.0
    """`--mem-fraction-static` (0: SGLang's default)."""
    max_running_requests: int = 0
    """0: SGLang's default."""
    max_queued_requests: int = 0
    """0: SGLang's default (unbounded); past it SGLang answers queue-full (503)."""
    served_model_name: str = ""
    max_loaded_loras: int = 0
    """With LoRA: `--max-loaded-loras` (adapters held in CPU memory at once; 0: SGLang's default, no limit)."""
    max_loras_per_batch: int = 0
    """With LoRA: `--max-loras-per-batch` (GPU slots for adapters; 0: SGLang's default, 8)."""
    lora_eviction_policy: str = ""
    """With LoRA: `--lora-eviction-policy` (lru or fifo: which adapter leaves a GPU slot; '': SGLang's, lru)."""
    extra_args: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        """Arguments after the command."""
        out = ["--model-path", self.model_path, "--host", "127.0.0.1", "--port", str(self.port)]
        if self.served_model_name:
            out += ["--served-model-name", self.served_model_name]
        if self.lora_rank > 0:
            out += ["--enable-lora", "--max-lora-rank", str(self.lora_rank)]
            if self.lora_target_modules:
                out += ["--lora-target-modules", *self.lora_target_modules]
            if self.max_loaded_loras > 0:
                out += ["--max-loaded-loras", str(self.max_loaded_loras)]
            if self.max_loras_per_batch > 0:
                out += ["--max-loras-per-batch", str(self.max_loras_per_batch)]
            if self.lora_eviction_policy:
                out += ["--lora-eviction-policy", self.lora_eviction_policy]
        if self.tp_size > 1:
            out += ["--tp-size", str(self.tp_size)]
        if self.dp_size > 1:
            out += ["--dp-size", str(self.dp_size)]
        if self.mem_fraction > 0:
            out += ["--mem-fraction-static", str(self.mem_fraction)]
        if self.max_running_requests > 0:
            out += ["--max-running-requests", str(self.max_running_requests)]
        if self.max_queued_requests > 0:
            out += ["--max-queued-requests", str(self.max_queued_requests)]
        return out + list(self.extra_args)


def serving_gpus(visible: Sequence[str], tp_size: int, dp_size: int) -> list[str] | None:
    """GPUs for SGLang: the last tp*dp of `visible` when more are visible (the trainer's ranks use
    the first ones, cuda:0..N-1), else None (share all GPUs; size `sglang_mem_fraction` for it)."""
    need = tp_size * dp_size
    return list(visible[-need:]) if len(visible) > need else None


class SGLangServer:
    """One launched SGLang server process."""

    def __init__(
        self,
        config: SGLangLaunchConfig,
        log_path: Path,
        *,
        command: Sequence[str] = DEFAULT_COMMAND,
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 900.0,
        poll_s: float = 1.0,
        stop_timeout_s: float = 20.0,
    ) -> None:
        self.config = config
        self.log_path = log_path
        """Where the server's stdout and stderr go."""
        self.command = list(command)
        self.env = dict(env) if env is not None else None
        self.startup_timeout_s = startup_timeout_s
        self.poll_s = poll_s
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> str:
        """Launch and wait until healthy; return the base URL. Blocking."""
        if self.proc is not None:
            raise RuntimeError("already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(self.env or {})
        cmd = [*self.command, *self.config.argv()]
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self.url

    def wait_healthy(self) -> None:
        """Poll `/health_generate` (then `/health`) until 200, the process exits, or the deadline."""
        deadline = time.monotonic() + self.startup_timeout_s
        last = "no answer yet"
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"sglang exited with {self.proc.returncode} while starting; log "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            for path in ("/health_generate", "/health"):
                try:
                    r = httpx.get(self.url + path, timeout=max(self.poll_s, 5.0))
                except httpx.HTTPError as exc:
                    last = repr(exc)
                    break
                if r.status_code == 200:
                    return
                last = f"{path} -> {r.status_code}"
                if r.status_code != 404:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"sglang not healthy after {self.startup_timeout_s:.0f}s ({last}); log "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(self.poll_s)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after `stop_timeout_s`. Idempotent."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, self.stop_timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)  # the group started with it (start_new_session)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue
