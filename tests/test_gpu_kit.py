"""The GPU kit (bench/gpu/) on CPU: its --quick table in this venv, and its offline install into a
fresh venv from a wheel folder built by build_wheelhouse.sh (needs the package index once)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KIT = ROOT / "bench" / "gpu"
PARTS = ("demo", "train", "decode", "publish", "sglang", "fsdp-N")
BOX = ("transformers>=5,<6", "peft", "safetensors", "tokenizers", "httpx", "rich", "typer", "prometheus-client")
"""The GPU box image's packages besides torch (bench/gpu/closure.py's BOX), installed to emulate it."""


def check_table(out: str) -> None:
    """Every part has a row; the parts a CPU can run ran; the GPU-only ones say why they were skipped."""
    lines = [ln for ln in out.splitlines() if " | " in ln]
    rows = {p: [ln for ln in lines if ln.split(" | ")[0].strip() == p] for p in PARTS}
    assert all(rows.values()), out
    assert len(rows["demo"]) == 2 and len(rows["train"]) == 4 and len(rows["decode"]) == 3, out
    assert len(rows["publish"]) == 2, out
    for part in ("demo", "train", "decode", "publish"):
        assert not any("failed:" in ln or "skipped:" in ln for ln in rows[part]), out
    assert "tok/s" in rows["train"][0] and "plain loop" in rows["train"][0], out
    assert "skipped: " in rows["sglang"][0] and "skipped: 0 GPU(s) visible" in rows["fsdp-N"][0], out


def test_kit_quick_table_on_cpu_in_this_venv(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(KIT / "kit.py"), "--quick", "--device", "cpu", "--work", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    check_table(r.stdout)


@pytest.mark.slow
def test_kit_installs_offline_into_a_fresh_venv_and_runs(tmp_path: Path) -> None:
    wh, venv = tmp_path / "wheelhouse", tmp_path / "venv"
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    build = subprocess.run(["bash", str(KIT / "build_wheelhouse.sh"), str(wh)], capture_output=True, text=True,
                           env={**os.environ, "PYTHON": sys.executable, "PYTHON_VERSION": pyver}, timeout=600)
    if build.returncode == 3:
        pytest.skip(f"the wheel folder cannot be built without the package index: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stdout + build.stderr
    size = sum(f.stat().st_size for f in wh.iterdir())
    assert size < 60 * 2**20, f"wheel folder {size / 2**20:.1f} MiB"

    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)  # no system site-packages
    py = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # The box image: torch as scripts/install.sh installs it here (a local CPU wheel), then its packages.
    subprocess.run([py, "-m", "pip", "install", "-q", f"torch=={os.environ.get('TORCH_VERSION', '2.13.0')}"],
                   check=True, env=env, timeout=900)
    subprocess.run([py, "-m", "pip", "install", "-q", *BOX], check=True, env=env, timeout=900)
    missing = subprocess.run([py, "-c", "import fastapi"], capture_output=True, env=env)
    assert missing.returncode != 0, "the emulated box must lack fastapi, as the real one does"

    # The kit: no index, no find-links but the wheel folder, no pip configuration.
    offline = {k: v for k, v in env.items() if not k.startswith("PIP_")}
    offline.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", OMP_NUM_THREADS="1", PYTHON=py,
                   WHEELHOUSE=str(wh))
    r = subprocess.run(["bash", str(KIT / "run.sh"), "--quick", "--device", "cpu", "--work", str(tmp_path / "w")],
                       capture_output=True, text=True, env=offline, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    check_table(r.stdout)
    where = subprocess.run([py, "-c", "import fastapi, clawbridge_local; print(clawbridge_local.__file__)"],
                           capture_output=True, text=True, env=offline, check=True).stdout
    assert str(venv) in where
