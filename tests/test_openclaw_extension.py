"""The OpenClaw extension's own unit tests (Node's test runner), run from pytest."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from clawbridge.openclaw.toolchain import find_node, missing_reason

EXT = Path(__file__).resolve().parents[1] / "extensions" / "openclaw"


@pytest.fixture(scope="module")
def node() -> Path:
    reason = missing_reason(need_openclaw=False)
    if reason is not None:
        pytest.skip(reason)
    found = find_node()
    assert found is not None
    return found


def test_extension_unit_tests_pass(node: Path) -> None:
    tests = sorted(str(p.relative_to(EXT)) for p in (EXT / "test").glob("*.test.mjs"))
    assert tests, "no extension tests found"
    proc = subprocess.run([str(node), "--test", *tests], cwd=EXT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "# fail 0" in proc.stdout or "ℹ fail 0" in proc.stdout


def test_committed_index_js_matches_source(node: Path) -> None:
    if not (EXT / "node_modules" / "typescript").is_dir():
        pytest.skip(
            "TypeScript is not installed in extensions/openclaw: run `npm ci` there (pinned devDependency)"
        )
    proc = subprocess.run(
        [str(node), "scripts/build.mjs", "--check"], cwd=EXT, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
