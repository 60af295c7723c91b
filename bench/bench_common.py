"""What the bench scripts share: the thread setting read before torch loads, and the model sizes.

Import this before torch: `set_threads_from_argv` must run before torch reads OMP_NUM_THREADS.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from clawbridge.devtools.tinymodel import TinyModelSpec


def set_threads_from_argv(default: int) -> int:
    """Set OMP_NUM_THREADS from `--threads N` (or `--threads=N`) in argv, else `default`."""
    threads = default
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv):
            threads = int(sys.argv[i + 1])
        elif a.startswith("--threads="):
            threads = int(a.split("=", 1)[1])
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads


def exit_on_sigterm() -> None:
    """Turn SIGTERM into `SystemExit(143)`, so `finally` blocks stop the servers a bench started
    (Python's default SIGTERM ends the process at once, leaving `clawbridge up` and its trainer
    running)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def model_specs() -> dict[str, TinyModelSpec]:
    """The bench model sizes: `tiny` (the test model, ~1.2M parameters) and `small` (~5M)."""
    from clawbridge.devtools.tinymodel import TinyModelSpec

    return {
        "tiny": TinyModelSpec(),
        "small": TinyModelSpec(
            hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
            intermediate_size=768,
        ),
    }


def rss_mib() -> float:
    """This process's resident set size now, in MiB (/proc/self/status VmRSS)."""
    from pathlib import Path

    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def model_folder(name: str, tmp: str) -> str:
    """A model folder: `tiny` (built into `tmp`) or `smollm2` (SmolLM2-135M-Instruct, converted once
    into the model cache by `clawbridge.models`)."""
    from pathlib import Path

    if name == "tiny":
        from clawbridge.devtools.tinymodel import build_tiny_model

        return str(build_tiny_model(Path(tmp) / "tiny"))
    from clawbridge.models import cached_model

    return str(cached_model("smollm2-135m-instruct"))
