"""The built packages, installed as a user installs them (not from the checkout).

1. `pip wheel --no-deps` builds the four wheels (clawbridge, clawbridge-local, -tinker, -fireworks);
   the clawbridge wheel must carry the OpenClaw extension.
2. A fresh venv gets torch==2.13.0 first (the local CPU build: a looser torch requirement installed
   first pulls GBs of CUDA wheels), then the four wheels, non-editable, their dependencies from
   the package index. From a folder outside the checkout, with no PYTHONPATH:
   `clawbridge demo` (shortened), `clawbridge openclaw install` into a scratch config with no
   OpenClaw on PATH, `clawbridge doctor` (and the hosted backends' SDK version lines), and a model
   call through `clawbridge up` with the venv's own `openai` SDK.
3. The same as a tool: `uv tool install <clawbridge wheel> --with torch==2.13.0 --with <local
   backend wheel>` (the README's way; uv comes from the package index), then the demo and
   `clawbridge openclaw install`. uv reads no pip configuration, so it is given pip's
   `find-links` (where the local CPU torch build is).

Every step has a timeout. pip's cache (and uv's) lives in `$CLAWBRIDGE_WHEEL_TEST_CACHE`, default
`<tmp>/clawbridge-wheel-test-cache`, never under the home directory, so a second run downloads
nothing. Skipped, saying so, when the package index cannot be reached.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from clawbridge.openclaw.installer import EXTENSION_FILES
from tests.support import ProxyProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[1]
PROJECTS = {
    "clawbridge": ROOT,
    "clawbridge_local": ROOT / "backends" / "local",
    "clawbridge_tinker": ROOT / "backends" / "tinker",
    "clawbridge_fireworks": ROOT / "backends" / "fireworks",
}
TORCH = "torch==2.13.0"
STEP_TIMEOUT_S = 1200


def _cache() -> Path:
    path = Path(os.environ.get("CLAWBRIDGE_WHEEL_TEST_CACHE") or Path(tempfile.gettempdir()) / "clawbridge-wheel-test-cache")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _env(extra_path: Path | None = None) -> dict[str, str]:
    """The environment of a user's shell: no PYTHONPATH, no clawbridge settings, a temp pip cache."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith(("CLAWBRIDGE_", "OPENCLAW_", "UV_"))}  # fmt: skip
    env.update(PIP_CACHE_DIR=str(_cache() / "pip"), PIP_DISABLE_PIP_VERSION_CHECK="1", OMP_NUM_THREADS="1")
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and not p.startswith(str(Path(sys.executable).parent))]
    env["PATH"] = os.pathsep.join(([str(extra_path)] if extra_path else []) + path)
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = STEP_TIMEOUT_S,
         stdout_only: bool = False) -> str:
    """The command's output (stdout then stderr; `stdout_only`: what a pipe gets, e.g. `--json`)."""
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    print(f"$ {' '.join(cmd)}  ({time.monotonic() - started:.0f} s, exit {proc.returncode})")
    assert proc.returncode == 0, f"{cmd[:4]} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}"
    return proc.stdout if stdout_only else proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    probe = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(out / "probe"), "six"],
        env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"the package index cannot be reached (pip download six: {probe.stderr.strip()[-300:]})")
    # Built from a copy: an in-tree build leaves build/ behind, and a stale build/lib (a module
    # moved or deleted since) would end up in the next wheel built from the checkout.
    src = out / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "node_modules", "__pycache__", ".*_cache", "*.tgz",
        "wheelhouse", "out"))  # fmt: skip
    projects = [src / Path(path).relative_to(ROOT) for path in PROJECTS.values()]
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), *map(str, projects)],
         cwd=out, env=_env())  # fmt: skip
    found = {name: next(out.glob(f"{name}-*.whl")) for name in PROJECTS}
    return found


def test_the_clawbridge_wheel_carries_the_openclaw_extension(wheels: dict[str, Path]) -> None:
    with zipfile.ZipFile(wheels["clawbridge"]) as z:
        names = set(z.namelist())
        for name in EXTENSION_FILES:
            packaged = f"clawbridge/openclaw/extension/{name}"
            assert packaged in names, sorted(n for n in names if "openclaw" in n)
            assert z.read(packaged) == (ROOT / "extensions" / "openclaw" / name).read_bytes()


@pytest.fixture(scope="module")
def venv(wheels: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("venv")
    venv = root / "venv"
    env = _env()
    _run([sys.executable, "-m", "venv", str(venv)], cwd=root, env=env)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    _run([*pip, TORCH], cwd=root, env=env)
    _run([*pip, *map(str, wheels.values())], cwd=root, env=env)
    yield venv


def _user(venv: Path, work: Path) -> dict[str, str]:
    env = _env(venv / "bin")
    env["HOME"] = str(work / "home")  # a scratch home: nothing of the developer's is read or written
    (work / "home").mkdir(parents=True, exist_ok=True)
    return env


def test_installed_wheels_run_demo_openclaw_install_doctor_and_a_model_call(venv: Path, tmp_path: Path) -> None:
    env, bin_ = _user(venv, tmp_path), venv / "bin"
    where = _run([str(bin_ / "python"), "-c", "import clawbridge, clawbridge_local, clawbridge_tinker, "
                  "clawbridge_fireworks as f; print(clawbridge.__file__, f.__file__)"], cwd=tmp_path, env=env)  # fmt: skip
    assert str(ROOT) not in where and "site-packages" in where, where  # the wheels, not the checkout

    out = _run([str(bin_ / "clawbridge"), "demo", "--sessions", "48", "--out", str(tmp_path / "demo")],
               cwd=tmp_path, env=env)  # fmt: skip
    assert (tmp_path / "demo").is_dir() and list((tmp_path / "demo").rglob("*.png")), out

    state = tmp_path / "state"
    _run([str(bin_ / "clawbridge"), "model", "tiny", str(tmp_path / "tiny")], cwd=tmp_path, env=env)
    proxy = ProxyProcess(tmp_path / "tiny", state, env=env, command=(str(bin_ / "clawbridge"),)).start(180)
    try:
        cfg = tmp_path / "scratch-openclaw" / "openclaw.json"
        out = _run([str(bin_ / "clawbridge"), "openclaw", "install", "--openclaw-config", str(cfg),
                    "--state-dir", str(state), "--base-url", f"{proxy.base}/v1"], cwd=tmp_path, env=env)  # fmt: skip
        ext = (state / "openclaw" / "extension").resolve()
        assert f"created {cfg}" in out and f"extension files copied to {ext}" in out, out
        assert all((ext / name).is_file() for name in EXTENSION_FILES)
        status = json.loads(_run([str(bin_ / "clawbridge"), "openclaw", "status", "--openclaw-config", str(cfg),
                                  "--state-dir", str(state), "--json"], cwd=tmp_path, env=env, stdout_only=True))  # fmt: skip
        assert status["installed"] is True and status["extension_current"] is True

        doctor = _run([str(bin_ / "clawbridge"), "doctor", "--state-dir", str(tmp_path / "state2")], cwd=tmp_path, env=env)
        assert "backend 'local' installed" in doctor
        for backend, line in (("tinker", "tinker 0.38.0 installed"), ("fireworks", "fireworks-ai 1.2.30")):
            proc = subprocess.run([str(bin_ / "clawbridge"), "doctor", "--backend", backend, "--state-dir",
                                   str(tmp_path / "state2")], cwd=tmp_path, env=env, capture_output=True,
                                  text=True, timeout=300)  # fmt: skip
            assert f"ok   {line}" in proc.stdout, proc.stdout + proc.stderr  # (its key is not set: exit 1)

        call = (
            "import openai, sys; c = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2]); "
            "r = c.chat.completions.create(model='tiny', max_tokens=8, messages=[{'role': 'user', 'content': 'hi'}], "
            "extra_headers={'X-Session-Id': 'wheel-s1'}); print(r.choices[0].finish_reason, len(r.choices[0].message.content or ''))"
        )
        _run([str(bin_ / "python"), "-c", call, f"{proxy.base}/v1", proxy.key()], cwd=tmp_path, env=env)
        shown = json.loads(_run([str(bin_ / "clawbridge"), "sessions", "show", "wheel-s1", "--json", "--state-dir",
                                 str(state)], cwd=tmp_path, env=env, stdout_only=True))  # fmt: skip
        assert len(shown["turns"]) == 1 and shown["turns"][0]["completion_token_ids"]
    finally:
        proxy.stop()


def _torch_find_links() -> str | None:
    """Where pip here finds the local CPU torch build (`find-links`), for uv, which reads no pip
    configuration."""
    if os.environ.get("PIP_FIND_LINKS"):
        return os.environ["PIP_FIND_LINKS"]
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    return proc.stdout.strip() or None


def test_uv_tool_install_with_the_local_backend(wheels: dict[str, Path], tmp_path: Path) -> None:
    env = _env()
    env.update(HOME=str(tmp_path / "home"), UV_CACHE_DIR=str(_cache() / "uv"), UV_TOOL_DIR=str(tmp_path / "uv-tools"),
               UV_TOOL_BIN_DIR=str(tmp_path / "uv-bin"), UV_PYTHON_DOWNLOADS="never")  # fmt: skip
    (tmp_path / "home").mkdir()
    find_links = _torch_find_links()
    if find_links is None:
        pytest.skip("pip here has no find-links with a CPU torch build; uv would pull torch's CUDA wheels (GBs)")
    uv_venv = tmp_path / "uv"
    _run([sys.executable, "-m", "venv", str(uv_venv)], cwd=tmp_path, env=env)
    _run([str(uv_venv / "bin" / "python"), "-m", "pip", "install", "-q", "uv"], cwd=tmp_path, env=env)
    _run([str(uv_venv / "bin" / "uv"), "tool", "install", str(wheels["clawbridge"]), "--with", TORCH,
          "--with", str(wheels["clawbridge_local"]), "--find-links", find_links,
          "--python", getattr(sys, "_base_executable", sys.executable)], cwd=tmp_path, env=env)  # fmt: skip
    clawbridge = tmp_path / "uv-bin" / "clawbridge"
    tool_python = tmp_path / "uv-tools" / "clawbridge" / "bin" / "python"
    versions = _run([str(tool_python), "-c", "import torch, clawbridge_local; print(torch.__version__)"],
                    cwd=tmp_path, env=env)  # fmt: skip
    assert versions.strip().startswith("2.13.0"), versions
    out = _run([str(clawbridge), "demo", "--sessions", "24", "--out", str(tmp_path / "demo")], cwd=tmp_path, env=env)
    assert list((tmp_path / "demo").rglob("*.png")), out
    cfg = tmp_path / "oc" / "openclaw.json"
    out = _run([str(clawbridge), "openclaw", "install", "--openclaw-config", str(cfg), "--state-dir",
                str(tmp_path / "state"), "--base-url", "http://127.0.0.1:9/v1"], cwd=tmp_path, env=env)  # fmt: skip
    assert f"created {cfg}" in out and (tmp_path / "state" / "openclaw" / "extension" / "index.js").is_file(), out


def test_setup_py_packages_the_files_the_installer_needs() -> None:
    """Fast (no build): the list setup.py copies into the wheel is the installer's list."""
    import ast

    tree = ast.parse((ROOT / "setup.py").read_text())
    lists = [ast.literal_eval(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "EXTENSION_FILES" for t in node.targets)]  # fmt: skip
    assert lists == [EXTENSION_FILES]
