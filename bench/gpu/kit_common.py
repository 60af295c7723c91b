"""What the GPU kit's parts share: a table row, the run's sizes and placement (`Kit`), the bench
scripts imported by name, and `attempt`, which turns a measurement that breaks into a `failed:` row.
"""

from __future__ import annotations

import importlib.util
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TypeVar

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
                    "L4": 121.0, "A10": 125.0, "RTX 4090": 165.0, "B200": 2250.0}
"""Dense bf16 tensor-core peak per GPU name (vendor datasheets; SXM figures for H100/A100). MFU
uses the first key found in `torch.cuda.get_device_name()`; `--peak-tflops` overrides."""
API_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cuGraphLaunch", "cudaMemcpy", "cudaMemset")
"""Name prefixes of the CUDA API calls a decode step makes from the host (kernel and graph
launches, copies; CUPTI may add a version suffix), counted per token by the `graphs` part."""


@dataclass
class Row:
    """One line of the table."""

    part: str
    what: str
    figure: str
    baseline: str = ""


class Skip(Exception):
    """A part that cannot run here; the message is the reason."""


@dataclass
class Kit:
    """Sizes and placement of one run."""

    device: str
    quick: bool
    work: Path
    peak_tflops: float | None

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.cuda else "float32"

    def shape_dir(self, name: str) -> Path:
        """The shape's model folder, built once per run (random weights drawn on the device, bf16
        on CUDA; scaled to 2 layers with --quick) and shared by the parts."""
        from clawbridge.devtools.shapes import SHAPES, build_shape, scaled

        out = self.work / name
        if not (out / "config.json").exists():  # written last: a cut build is built again
            shape = scaled(SHAPES[name], layers=2, hidden=128, vocab=6000) if self.quick else SHAPES[name]
            t0 = time.perf_counter()
            build_shape(out, shape, dtype="bf16" if self.cuda else "fp32", seed=0,
                        device=self.device if self.cuda else "cpu")
            print(f"[kit] built {name} in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        return out

    def label(self, shape: str) -> str:
        return shape + (" (scaled)" if self.quick else "")

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def free(self) -> None:
        import gc

        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.empty_cache()


def bench_module(name: str) -> ModuleType:
    """Import bench/<name>.py (the bench scripts are scripts, not a package)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def attempt(part: str, what: str, rows: Callable[[], Iterator[Row]]) -> Iterator[Row]:
    """The rows of one measurement; if it breaks, a `failed:` row (traceback on stderr) and no more."""
    try:
        yield from rows()
    except Skip as s:
        yield Row(part, what, f"skipped: {s}")
    except Exception as exc:
        traceback.print_exc()
        yield Row(part, what, f"failed: {type(exc).__name__}: {str(exc)[:200]}")


