"""Give freed tensor memory back to the OS: glibc's mmap threshold, fixed (issue 32 §1).

Why: `clawbridge up` with the in-process LoRA trainer grew by hundreds of MiB at every training
step and never came down (SmolLM2, batch 4 x ~300 tokens: 894 MiB loaded, 2113 / 2365 / 2428 MiB
after three steps). A step allocates and frees many tensors of a few MiB (a layer's activations:
[B, T, intermediate] floats). glibc serves a block that large with its own mmap, returned to the OS
when freed, but raises its mmap threshold to the size of each such block freed (up to 32 MiB), so
from the second step on these blocks come from the heap, whose free space fragments and is kept.
The same run with the threshold fixed at 1 MiB: 1126 / 1213 / 1214 MiB (`MALLOC_MMAP_THRESHOLD_`
does the same from the environment; docs/engine-memory.md has the figures).

Invariants:
- `fix_mmap_threshold` changes nothing but glibc's `M_MMAP_THRESHOLD` (process-wide, for blocks
  allocated from then on), and only with glibc; elsewhere it says so and does nothing.
- Blocks at or above the threshold are mapped and unmapped one by one: RSS follows what is alive,
  for a page fault per page first written (measured in bench/engine_memory.py's rows).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("clawbridge.local")

M_MMAP_THRESHOLD = -3
"""glibc's `mallopt` parameter number (malloc.h)."""


def fix_mmap_threshold(threshold_bytes: int) -> bool:
    """Serve every allocation of at least `threshold_bytes` with its own mmap, returned to the OS
    when freed, and stop glibc from raising that threshold; False where that cannot be done (not
    glibc, or `threshold_bytes` <= 0: leave the allocator as it is)."""
    if threshold_bytes <= 0 or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.info("not glibc: the allocator's mmap threshold stays as it is")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, int(threshold_bytes)))
    if ok:
        log.info("allocations of %d KiB and more are mapped apart and given back when freed "
                 "(malloc_mmap_threshold_kib)", threshold_bytes // 1024)
    return ok
