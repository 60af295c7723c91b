"""What the privacy filter costs per training sequence: `redact_datum` on a one-turn datum whose
prompt is a ~40 KB system prompt (README text) rendered with the tiny model's tokenizer, without a
finding and with one e-mail address planted, beside decoding the same tokens once (the baseline:
the filter's first pass decodes them too).

Run (seconds):
    . .venv/bin/activate && OMP_NUM_THREADS=1 python bench/privacy_filter.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from clawbridge.backend import Datum
from clawbridge.chat.render import Renderer
from clawbridge.devtools.tinymodel import build_tiny_model
from clawbridge.privacy.detect import DetectorFilter
from clawbridge.privacy.tokens import redact_datum

ROOT = Path(__file__).resolve().parent.parent


def main(repeats: int = 5) -> None:
    renderer = Renderer.from_pretrained(str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")))
    system = (ROOT / "README.md").read_text(encoding="utf-8")[:40_000]
    pfilter = DetectorFilter()
    for label, extra in (("no finding", ""), ("one e-mail", " Write to alice.w@example.org. ")):
        prompt = renderer.render([{"role": "system", "content": system + extra}, {"role": "user", "content": "hi"}])
        answer = renderer.encode("Hello there.<|im_end|>")
        datum = Datum.from_turn(prompt, answer, [-0.1] * len(answer), [1.0] * len(answer), 0, "t")
        decode = redact = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            renderer.decode(datum.tokens)
            t1 = time.perf_counter()
            out = redact_datum(datum, renderer, pfilter)
            t2 = time.perf_counter()
            decode, redact = decode + t1 - t0, redact + t2 - t1
        print(f"{label}: {len(datum.tokens)} tokens; decode (baseline) {1000 * decode / repeats:.1f} ms, "
              f"redact_datum {1000 * redact / repeats:.1f} ms (mean of {repeats}); masked {dict(out.masked)}")


if __name__ == "__main__":
    main()
