"""What the bench scripts share: the thread setting read before torch loads, and the model sizes.

Import this before torch: `set_threads_from_argv` must run before torch reads OMP_NUM_THREADS.
"""

from __future__ import annotations

import os
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
