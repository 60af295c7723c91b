"""Every example a user would paste from README.md and docs/*.md works as pasted.

The shell (`bash`, `sh`, `console`: its `$ ` lines) and Python blocks run in page order (README
first, then docs/ by name), one command at a time, in one fresh HOME (so the default state dir
and the keys are new), from the repository root, the way a reader who follows the README and then
the docs would run them. A command must exit 0. A `clawbridge up` starts in the background (as in
its own terminal) and must answer `/health`; the next `up` stops it first (Ctrl-C), as a reader
would. JSON blocks must parse and TOML blocks must load as a `--config` file. What differs from a
reader's terminal, and only this: `.venv/bin/` is the interpreter's own bin folder, and the docs'
port 8400 is a free port (other tests run beside this one), also given as `CLAWBRIDGE_PORT`.

The few commands that cannot run here are listed in `SKIPPED`, each with the reason (a GPU, a
hosted service's key, OpenClaw, a second machine, or a run of minutes that another test makes);
an entry that matches nothing fails the test, so the list cannot go stale. Nothing a command
leaves behind may land in the repository (`git status` before and after).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from clawbridge.config import load_settings
from tests.conftest import model_cache_dir
from tests.support import free_port

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
DOCS_PORT = "8400"

SKIPPED: dict[str, str] = {
    "bash scripts/install.sh": "creates .venv from the package index: CI's first step (.ci/run) is this install; "
                               "the demo after it is tests/test_demo.py",
    ".venv/bin/python -m pytest -q": "the whole test suite, this test included",
    "clawbridge demo --model smollm2": "the real demo takes 4-7 minutes on 2 cores: tests/test_realdemo.py runs it",
    "TINKER_API_KEY=... clawbridge up": "needs a Tinker key (a hosted service)",
    "TINKER_API_KEY=... clawbridge doctor": "needs a Tinker key (a hosted service)",
    "FIREWORKS_API_KEY=... FIREWORKS_ACCOUNT_ID=... clawbridge up": "needs a Fireworks key and account (a hosted, "
                                                                   "billable service)",
    "git archive a3d82fb": "a benchmark against an older commit (minutes of rounds; docs/benchmarks.md's figures)",
    "python bench/proxy_overhead.py": "a benchmark (minutes of rounds; docs/benchmarks.md's figures)",
    "python bench/privacy_filter.py": "a benchmark; the page shows one run's figures",
    "python -m clawbridge_local.trainer.node": "runs on a second machine, joining a multi-node trainer",
    "pip wheel --no-deps -w dist": "builds the four wheels: tests/test_wheels.py builds them and installs them in a "
                                   "fresh venv (pip and uv), then runs the demo from there",
    "python -m venv ~/clawbridge-venv": "a fresh venv with torch: tests/test_wheels.py",
    "~/clawbridge-venv/bin/pip install dist/": "installs the built wheels: tests/test_wheels.py",
    "uv tool install dist/": "needs uv; tests/test_wheels.py installs uv into its venv and runs this",
    "pipx install dist/": "needs pipx (tried by hand: docs/install.md's timings)",
    "pipx inject clawbridge": "needs pipx (tried by hand: docs/install.md's timings)",
    "cd extensions/openclaw && npm pack": "needs npm; tests/test_openclaw_plugin_package.py packs the plugin",
    "openclaw plugins install ./extensions/openclaw": "needs OpenClaw on PATH; tests/test_openclaw_plugin_package.py "
                                                      "installs the tarball into a real OpenClaw",
}
"""Commands (a text each contains) that do not run here, with the reason."""


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True)
class Command:
    block: Block
    text: str


def blocks(page: Path) -> Iterator[Block]:
    """The fenced code blocks of a markdown page, with their language tag and first line."""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^\s*```([\w+-]*)\s*$", lines[i])
        if m is None:
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i])
            i += 1
        yield Block(page, start, m.group(1).lower(), "\n".join(body))
        i += 1


def commands(block: Block) -> list[Command]:
    """A shell block's commands (a line, with its `\\` continuations; in a `console` block only the
    `$ ` lines), or a Python block whole."""
    if block.lang == "python":
        return [Command(block, block.text)]
    out: list[str] = []
    pending = ""
    for raw in block.text.splitlines():
        line = raw
        if block.lang == "console" and not pending:
            if not raw.startswith("$ "):
                continue
            line = raw[2:]
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    return [Command(block, c) for c in out]


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page)]


def skip_reason(command: Command) -> str | None:
    found = [reason for key, reason in SKIPPED.items() if key in command.text]
    assert len(found) <= 1, f"{command.block.where}: several SKIPPED entries match {command.text!r}"
    return found[0] if found else None


def test_every_pasteable_block_is_tagged_and_every_skip_matches() -> None:
    """A block that looks like commands carries a language tag (so the run below sees it), and each
    SKIPPED entry names a command that is still in the docs."""
    untagged = [b.where for b in all_blocks() if not b.lang and re.match(
        r"\s*(\$ |\.venv/|clawbridge |python |curl |git |bash |pip )", b.text)]
    assert not untagged, f"tag these blocks (bash, console, python, ...): {untagged}"
    texts = [c.text for b in all_blocks() if b.lang in SHELL | {"python"} for c in commands(b)]
    stale = [key for key in SKIPPED if not any(key in t for t in texts)]
    assert not stale, f"SKIPPED entries that match no command in the docs any more: {stale}"


def test_data_blocks_parse(tmp_path: Path) -> None:
    """JSON blocks are JSON (or JSON lines); TOML blocks load as a `--config` file."""
    for block in all_blocks():
        if block.lang == "json":
            try:
                json.loads(block.text)
            except ValueError:
                for line in block.text.splitlines():
                    json.loads(line)
        elif block.lang == "toml":
            tomllib.loads(block.text)
            path = tmp_path / "config.toml"
            path.write_text(block.text)
            load_settings(path)


class Reader:
    """A reader's terminal: a fresh HOME, and at most one `clawbridge up` running."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.port = str(free_port())
        self.bin = Path(sys.executable).parent
        keep = ("CLAWBRIDGE_MODEL_CACHE", "CLAWBRIDGE_CACHE")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWBRIDGE_") or k in keep}
        self.env.update(HOME=str(home), CLAWBRIDGE_PORT=self.port, OMP_NUM_THREADS="1",
                        CLAWBRIDGE_MODEL_CACHE=str(model_cache_dir()),
                        PATH=f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}")
        self.server: subprocess.Popen[bytes] | None = None
        self.server_log = home / "up.log"
        self.ran: list[str] = []

    def pasted(self, text: str) -> str:
        return re.sub(rf"(?<!\d){DOCS_PORT}(?!\d)", self.port, text.replace(".venv/bin/", f"{self.bin}/"))

    def run(self, command: Command) -> None:
        text = self.pasted(command.text)
        where = f"{command.block.where}: {command.text}"
        if command.block.lang == "python":
            argv = [sys.executable, "-c", text]
        elif re.search(r"\bclawbridge up\b", text):
            self.start_server(text, where)
            return
        else:
            argv = ["bash", "-c", text]
        out = subprocess.run(argv, cwd=ROOT, env=self.env, input="y\n", capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, (f"{where}\nexited {out.returncode}\n--- stdout\n{out.stdout[-3000:]}\n"
                                     f"--- stderr\n{out.stderr[-3000:]}")
        self.ran.append(where)

    def start_server(self, text: str, where: str) -> None:
        self.stop_server()
        with self.server_log.open("wb") as log:
            self.server = subprocess.Popen(["bash", "-c", text], cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline_s = 600.0
        start = time.monotonic()
        while time.monotonic() - start < deadline_s:
            if self.server.poll() is not None:
                raise AssertionError(f"{where}\nexited {self.server.returncode} instead of serving:\n"
                                     f"{self.server_log.read_text()[-4000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    self.ran.append(where)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"{where}\nnot serving after {deadline_s:.0f}s:\n{self.server_log.read_text()[-4000:]}")

    def stop_server(self) -> None:
        """Ctrl-C, as a reader stops `up` before starting another."""
        proc, self.server = self.server, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _repo_state() -> str | None:
    """`git status` of the repository (None when it is not a git checkout or git is missing)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    return out.stdout if out.returncode == 0 else None


@pytest.mark.slow
def test_the_docs_examples_run_as_pasted(smollm2_dir: Path, tmp_path: Path) -> None:
    """`smollm2_dir`: the README's real model comes from the test cache (converted once per machine;
    the test skips, saying why, where the package index cannot be reached)."""
    if not (Path(sys.executable).parent / "clawbridge").exists():
        pytest.skip(f"no clawbridge command beside {sys.executable}: install the package (scripts/install.sh)")
    home = tmp_path / "home"
    home.mkdir()
    reader = Reader(home)
    before = _repo_state()
    skipped: list[str] = []
    try:
        for block in all_blocks():
            if block.lang not in SHELL | {"python"}:
                continue
            for command in commands(block):
                reason = skip_reason(command)
                if reason is not None:
                    skipped.append(f"{block.where}: {command.text} ({reason})")
                    continue
                reader.run(command)
    finally:
        reader.stop_server()
    print("ran:\n  " + "\n  ".join(reader.ran) + "\nskipped:\n  " + "\n  ".join(skipped))
    assert len(reader.ran) >= 10, reader.ran
    assert _repo_state() == before, "a pasted command left files in the repository"
