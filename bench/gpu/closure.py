"""What a GPU box lacks: the wheels clawbridge + clawbridge-local need beyond the box image's packages.

Used by `build_wheelhouse.sh`. The box image (docs/gpu-kit.md) already has torch, transformers 5.x,
peft, safetensors, tokenizers, httpx, rich, typer and prometheus-client, with their dependencies.
pip resolves two sets for the target interpreter and platform (`pip install --dry-run --report`,
metadata only, nothing installed): the box's packages alone, and the box's packages + our two
wheels. The wheelhouse is the second set minus the first, pinned to the versions pip chose.

torch is stood in for by a stub wheel (`torch==<ver>+box`, torch's pure-Python dependencies, no
CUDA wheels): the box has torch already, and the CUDA wheels it would pull are not needed to
resolve anything else (and are not on every index).

Usage: python closure.py OUT_REQUIREMENTS_TXT OUR_WHEEL... (platform flags from $PIP_TARGET_FLAGS)
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

BOX = ("transformers>=5,<6", "peft", "safetensors", "tokenizers", "httpx", "rich", "typer", "prometheus-client")
"""What the GPU box image has besides torch (the issue's list)."""
TORCH_VERSION = os.environ.get("BOX_TORCH_VERSION", "2.11.0")
TORCH_DEPS = ("filelock", "typing-extensions>=4.10.0", "sympy>=1.13.3", "networkx>=2.5.1", "jinja2", "fsspec>=0.8.5",
              "setuptools")
"""torch's own requirements without its CUDA wheels (torch 2.x METADATA)."""
LEFT_OUT = {"pyarrow": "54 MiB alone; only `clawbridge export --format parquet` imports it (lazily)"}
"""Requirements of clawbridge the kit does not carry, and why (the folder must stay under 60 MiB).
run.sh therefore installs the pinned list with --no-deps."""


def stub_torch(folder: Path) -> str:
    """Write a metadata-only torch wheel; return the requirement that selects it."""
    version = f"{TORCH_VERSION}+box"
    dist = f"torch-{version}.dist-info"
    files = {
        f"{dist}/METADATA": "Metadata-Version: 2.1\nName: torch\nVersion: " + version + "\n"
        + "".join(f"Requires-Dist: {r}\n" for r in TORCH_DEPS),
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: clawbridge-gpu-kit\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return f"torch=={version}"


def resolve(reqs: list[str], stub_dir: Path, flags: list[str]) -> dict[str, str]:
    """pip's resolution of `reqs` for the target platform: {normalized name: version}."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--report",
               str(report), "--target", str(Path(tmp) / "t"), "--find-links", str(stub_dir), *flags, *reqs]
        subprocess.run(cmd, check=True)
        items = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in items}


def main(argv: list[str]) -> int:
    out, wheels = Path(argv[0]), argv[1:]
    flags = shlex.split(os.environ.get("PIP_TARGET_FLAGS", ""))
    with tempfile.TemporaryDirectory() as tmp:
        torch_req = stub_torch(Path(tmp))
        box = resolve([torch_req, *BOX], Path(tmp), flags)
        ours = resolve([torch_req, *BOX, *wheels], Path(tmp), flags)
    own = {"clawbridge", "clawbridge-local"}
    changed = {n: (box[n], v) for n, v in ours.items() if n in box and box[n] != v}
    if changed:
        print(f"note: with clawbridge, pip would change box packages: {changed} (kept as the box has them)")
    lacking = sorted(f"{n}=={v}" for n, v in ours.items() if n not in box and n not in own and n not in LEFT_OUT)
    for name, why in LEFT_OUT.items():
        print(f"left out: {name} ({why})")
    out.write_text("\n".join(lacking) + "\n")
    print(f"box image: {len(box)} packages; clawbridge adds {len(lacking)}: {' '.join(lacking)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
