"""The dashboard is readable on a desktop (1400 px) and a phone (390 px), measured in a real headless
Chromium from the DOM, on a real proxy with seeded data (`tests.dashboard_support.start_talking_proxy`:
rewards at three policy versions, steps whose kl and clip fraction are 0, a negative loss, a note from
a user's correction and a long note by hand):

- no table cell wraps inside a word or a number (every line break of every cell is measured);
- the page is never wider than the window (a wide table scrolls inside its card);
- every chart has readable ticks: at least two per axis, evenly spaced nice numbers (1, 2, 2.5 or 5
  times a power of ten) with one number of decimals, at least 9 px tall, none over another, and
  covering the data; kl and the clip fraction each on their own axis, the negative loss explained;
- the notes table and "still good?" show, and a note's delete button (admin login + CSRF) deletes
  it from the store.

Screenshots are kept in $CLAWBRIDGE_ARTIFACTS_DIR/dashboard-layout (default: the test's tmp dir).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clawbridge.devtools.judge_server import JudgeServer
from clawbridge.store.notes import NoteStore
from tests.dashboard_support import (
    CORRECTION,
    LONG_NOTE,
    TrainedProxy,
    screenshots_dir,
    start_talking_proxy,
    wait_for,
)
from tests.test_dashboard_browser import CHROMIUM, DRIVER, log_in, wait_js

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="needs Debian's chromium and chromium-driver (run .ci/install_chromium.sh)",
)

# Every line break inside a table cell: the last character shown before it, the first after it, what
# lies between them (a collapsed space has no box), and the cell's text.
BREAKS_JS = """
const out = [];
for (const cell of document.querySelectorAll('td, th')) {
  const chars = [];
  let text = '';
  const walk = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
  for (let n = walk.nextNode(); n; n = walk.nextNode()) {
    for (let i = 0; i < n.textContent.length; i++) {
      const r = document.createRange(); r.setStart(n, i); r.setEnd(n, i + 1);
      const rect = r.getClientRects()[0];
      if (rect && rect.width > 0) chars.push([n.textContent[i], rect.top, rect.left, text.length + i]);
    }
    text += n.textContent;
  }
  for (let i = 1; i < chars.length; i++) {
    if (chars[i][1] > chars[i - 1][1] + 3 && chars[i][2] < chars[i - 1][2])
      out.push([chars[i - 1][0], chars[i][0], text.slice(chars[i - 1][3] + 1, chars[i][3]), text]);
  }
}
return out;
"""
# Each chart that has data: its ticks (text, box) per axis, its plot's box, its points' centres.
CHARTS_JS = """
return [...document.querySelectorAll('svg.chart')].filter((s) => s.querySelector('circle.pt')).map((s) => {
  const box = (e) => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const ticks = (cls) => [...s.querySelectorAll(`g.${cls} text`)].map((t) => [t.textContent, box(t)]);
  return {id: s.id, svg: box(s), y: ticks('yticks'), x: ticks('xticks'),
          points: [...s.querySelectorAll('circle.pt')].map((c) => { const b = box(c); return [(b[0] + b[2]) / 2, (b[1] + b[3]) / 2]; }),
          series: s.querySelectorAll('g.series').length};
});
"""


@pytest.fixture(scope="module")
def talking(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainedProxy]:
    with JudgeServer() as judge:
        t = start_talking_proxy(tiny_model_dir, tmp_path_factory.mktemp("dash-layout-state"), judge.base_url)
        try:
            yield t
        finally:
            t.proxy.stop()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return screenshots_dir(tmp_path_factory, "dashboard-layout")


def open_browser(profile: Path, width: int) -> WebDriver:
    opts = Options()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
                f"--window-size={width},1000", f"--user-data-dir={profile}",
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                "--no-first-run", "--disable-background-networking", "--disable-component-update"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=str(DRIVER)))
    driver.set_page_load_timeout(60)
    return driver


def mid_word(before: str, after: str, between: str) -> bool:
    """A break that is not between words: not at a space, nor after . _ / , : = - before a letter
    (where the page lets a long name wrap)."""
    if between.strip() != between or before.isspace() or after.isspace():
        return False
    return not (before in "._/,:=-" and (after.isalpha() or after in "/~"))


def nice_step(step: float) -> bool:
    mantissa = step / 10 ** math.floor(math.log10(step))
    return any(math.isclose(mantissa, m, rel_tol=1e-6) for m in (1, 2, 2.5, 5, 10))


def check_axis(chart: str, axis: str, ticks: list[Any]) -> list[float]:
    labels = [t[0] for t in ticks]
    assert len(labels) >= 2, (chart, axis, labels)
    values = [float(x) for x in labels]
    assert all(not re.fullmatch(r"-0(\.0*)?", x) for x in labels), (chart, axis, labels)  # no "-0"
    assert len({len(x.split(".")[1]) if "." in x and "e" not in x else 0 for x in labels}) == 1, (chart, labels)
    diffs = [abs(b - a) for a, b in itertools.pairwise(values)]
    step = min(diffs)
    assert step > 0 and nice_step(step), (chart, axis, labels)
    assert all(math.isclose(d / step, round(d / step), abs_tol=1e-6) for d in diffs), (chart, axis, labels)
    boxes = [t[1] for t in ticks]
    assert all(b[3] - b[1] >= 9 for b in boxes), (chart, axis, "tick text under 9 px", boxes)
    for a, b in itertools.pairwise(boxes):  # no label over its neighbour
        assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1], (chart, axis, labels)
    return values


def test_readable_at_1400_and_390_px_and_a_note_deletes(talking: TrainedProxy, artifacts: Path,
                                                        tmp_path: Path) -> None:
    notes = NoteStore(talking.proxy.state.store)
    for width in (1400, 390):
        driver = open_browser(tmp_path / f"profile-{width}", width)
        try:
            log_in(driver, talking.base, talking.admin)
            wait_js(driver, "return document.body.dataset.loaded === '1' && "
                            "document.querySelectorAll('#notes tbody tr').length === 2", "the overview with its notes")
            height = driver.execute_script("return document.documentElement.scrollHeight")
            driver.set_window_size(width, height + 120)  # the whole page in one screenshot, laid out again
            wait_js(driver, "return document.querySelectorAll('#kl-chart g.yticks text').length >= 2", "a redraw")
            driver.save_screenshot(str(artifacts / f"overview-{width}.png"))

            breaks = driver.execute_script(BREAKS_JS)
            bad = [b for b in breaks if mid_word(b[0], b[1], b[2])]
            assert not bad, f"{width} px: cells wrapped inside a word: {bad[:5]}"
            assert any(b[3].startswith("Always cite") for b in breaks), "the long note wraps (between words)"
            page_width = driver.execute_script("return document.documentElement.scrollWidth")
            assert page_width <= driver.execute_script("return window.innerWidth"), (width, page_width)

            charts = {c["id"]: c for c in driver.execute_script(CHARTS_JS)}
            assert {"reward-chart", "version-chart", "loss-chart", "reward-mean-chart", "kl-chart",
                    "clip-chart"} <= set(charts), sorted(charts)
            for cid, c in charts.items():
                ys = check_axis(cid, "y", c["y"])
                check_axis(cid, "x", c["x"])
                top = min(t[1][1] for t in c["y"])  # the highest tick's label top .. the lowest's bottom
                bottom = max(t[1][3] for t in c["y"])
                assert all(top - 2 <= p[1] <= bottom + 2 for p in c["points"]), (cid, "data outside the ticks", ys)
            for cid in ("loss-chart", "kl-chart", "clip-chart"):  # one metric per axis: kl is not under the clip line
                assert charts[cid]["series"] == 1, cid
            assert [t[0] for t in charts["kl-chart"]["y"]] == ["0.0", "0.5", "1.0"]  # a flat zero line: 0 at the floor
            loss_note = driver.execute_script("return document.getElementById('loss-note').innerText")
            assert "a negative loss is normal" in loss_note and "sign follows the batch's advantages" in loss_note

            # read in one script: the page redraws every 2 s, so element handles go stale
            rows = driver.execute_script("return [...document.querySelectorAll('#notes tbody tr')].map(r => r.innerText)")
            assert any("alice" in r and "added by hand" in r for r in rows), rows
            assert any(CORRECTION in " ".join(r.split()) and "said once" in r for r in rows), rows
            assert driver.execute_script("return document.getElementById('still-good').innerText").startswith(
                "still good? ")
            config_cells = driver.execute_script(
                "return [...document.querySelectorAll('#config tbody tr td:first-child')].map(c => c.innerText)")
            assert "host" in config_cells and any(c.replace("\n", "") == "backends.local.engine"
                                                  for c in config_cells), config_cells[:10]
        finally:
            driver.quit()

    # the delete button: the cookie login and its CSRF token, the note gone from the store and the page
    hand = next(n for n in notes.listing() if n.text == LONG_NOTE)
    driver = open_browser(tmp_path / "profile-delete", 1400)
    try:
        log_in(driver, talking.base, talking.admin)
        wait_js(driver, "return document.querySelectorAll('#notes button.delete-note').length === 2", "the notes")
        driver.execute_script(f"document.querySelector(\"#notes button.delete-note[data-note-id='{hand.note_id}']\").click()")
        wait_for(lambda: notes.get(hand.note_id) is None, 30, "the note deleted from the store")
        wait_js(driver, "return document.querySelectorAll('#notes tbody tr').length === 1", "the row gone")
        assert "Always cite" not in driver.execute_script("return document.getElementById('notes').innerText")
    finally:
        driver.quit()
