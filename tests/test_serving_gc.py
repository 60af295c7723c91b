"""`clawbridge.server.tune_gc`: what `clawbridge serve` does to the cyclic collector once it listens
(run in a child process, so this test process keeps its own collector settings)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_tune_gc_freezes_start_up_and_raises_the_young_threshold() -> None:
    code = (
        "import gc, json\n"
        "from clawbridge.server import YOUNG_GC_THRESHOLD, tune_gc\n"
        "before = gc.get_threshold()\n"
        "tune_gc()\n"
        "print(json.dumps({'before': before, 'after': gc.get_threshold(), 'frozen': gc.get_freeze_count(),"
        " 'want': YOUNG_GC_THRESHOLD}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["after"][0] == got["want"] > got["before"][0]
    assert got["after"][1:] == got["before"][1:], "only the young generation's threshold changes"
    assert got["frozen"] > 10_000, "start-up's objects (the imported modules) are out of the generations"
