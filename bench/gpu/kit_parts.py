"""The parts of the GPU kit: each is a generator of table rows, run in its own process by
`bench/gpu/kit.py --part NAME` (docs/gpu-kit.md says what each row measures).

A part yields each row as soon as it has it, so a part cut by its time budget keeps the rows it
finished; a measurement inside a part that fails becomes a `failed: ...` row and the part goes on
with the next one. Every figure stands beside a baseline measured in the same run. The bench
scripts are reused (imported from bench/), not copied.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kit_common import Kit, Row
from kit_serving import decode_rows, graphs_rows, sglang_rows, sglang_skip
from kit_training import demo_rows, gpu_count, multi_gpu_rows, publish_rows, train_rows

__all__ = ["PARTS", "Kit", "Part", "Row"]


# ------------------------------------------------------------------------------------------------ env


def env_rows(kit: Kit) -> Iterator[Row]:
    import clawbridge_local
    import torch
    import transformers

    import clawbridge

    yield Row("env", "python / torch / transformers",
              f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")
    if kit.cuda:
        props = torch.cuda.get_device_properties(kit.device)
        free, total = torch.cuda.mem_get_info(kit.device)
        yield Row("env", "device", f"{props.name}, {total / 2**30:.0f} GiB ({free / 2**30:.0f} free), "
                  f"compute capability {props.major}.{props.minor}, {torch.cuda.device_count()} visible")
    else:
        yield Row("env", "device", f"cpu x{os.cpu_count()}")
    missing = [m for m in ("fastapi", "pydantic", "uvicorn", "openai", "peft")
               if importlib.util.find_spec(m) is None]
    yield Row("env", "clawbridge installed", f"{Path(clawbridge.__file__).parent}, "
              f"{Path(clawbridge_local.__file__).parent}" + (f"; missing: {missing}" if missing else ""))


@dataclass(frozen=True)
class Part:
    """One part: its rows, its time budget (full sizes / --quick) and, where it can be known without
    starting it, why it cannot run."""

    rows: Callable[[Kit], Iterator[Row]]
    budget_s: float
    quick_budget_s: float
    precheck: Callable[[Kit], str | None] = lambda kit: None


PARTS: dict[str, Part] = {
    # Quickest evidence first: what runs, then the engine (the slowest row of the last run), then training.
    "env": Part(env_rows, 60, 120),
    "graphs": Part(graphs_rows, 100, 300),
    "decode": Part(decode_rows, 120, 300),
    "train-0.6b": Part(lambda kit: train_rows(kit, "qwen3-0.6b"), 90, 300),
    "publish": Part(publish_rows, 75, 300),
    "train-1.7b": Part(lambda kit: train_rows(kit, "qwen3-1.7b"), 100, 300),
    "demo": Part(demo_rows, 150, 300),
    "sglang": Part(sglang_rows, 150, 60, sglang_skip),
    "fsdp-N": Part(multi_gpu_rows, 150, 120,
                   lambda kit: None if gpu_count(kit) >= 2 else f"{gpu_count(kit)} GPU(s) visible; multi-GPU FSDP "
                   "needs 2 or more"),
}
"""The kit's parts, in the order they run."""
