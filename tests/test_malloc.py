"""Freed tensor memory goes back to the OS (`clawbridge_local.malloc`, issue 32 §1): in a fresh
process, blocks of a few MiB allocated and freed the way a training step does leave it as large as
before once the mmap threshold is fixed."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("clawbridge_local")

ALLOC_CHURN = """
import sys
import torch
from clawbridge_local.malloc import fix_mmap_threshold

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024

fixed = fix_mmap_threshold(int(sys.argv[1]))
before = rss_mib()
keep = []
for i in range(30):  # a training step's pattern: blocks of 6-8 MiB of varying sizes, freed, small ones kept
    blocks = [torch.ones(1_500_000 + 37_000 * ((i * 7 + j) % 11)) for j in range(6)]
    keep.append(torch.ones(20_000))
    del blocks
print(fixed, rss_mib() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc (Linux)")
def test_freed_blocks_of_a_mib_and_more_go_back_to_the_os() -> None:
    """With the mmap threshold fixed at 1 MiB, blocks allocated and freed as a training step does
    leave the process as large as before; glibc's own (rising) threshold kept ~110 MiB of them here."""
    import subprocess
    import sys

    def grown(threshold: int) -> tuple[bool, int]:
        out = subprocess.run([sys.executable, "-c", ALLOC_CHURN, str(threshold)], capture_output=True, text=True,
                             check=True).stdout.split()
        return out[0] == "True", int(out[1])

    fixed, after = grown(1 << 20)
    assert fixed, "glibc's mallopt was not available"
    _, untouched = grown(0)
    assert after <= 16, (after, untouched)
