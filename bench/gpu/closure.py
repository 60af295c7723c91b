"""What a GPU box lacks: the wheels clawbridge + clawbridge-local need beyond the box image's packages.

Used by `build_wheelhouse.sh`. The box image's packages are listed in `box_image.txt` (the image's
real package list, with versions where known; `nvidia-*` stands for the CUDA libraries). pip
resolves, for the target interpreter and platform (`pip install --dry-run --report`, metadata only,
nothing installed), our two wheels, then again with the box's known versions of the packages that
first resolution reached pinned; the wheel folder is every resolved
package the image does not list, pinned to the version pip chose. Nothing is taken from a resolution
of the box's own packages: that picture (issue 36) wrongly had pydantic and its kin already on the box.

torch is stood in for by a stub wheel (`torch==<ver>+box`, torch's pure-Python dependencies, no
CUDA wheels): the box has torch already, and the CUDA wheels it would pull are not needed to
resolve anything else (and are not on every index). A known box version the index does not have
(numpy 2.5.2 on the box, newer than this index) is left unpinned, with a note.

Usage: python closure.py OUT_REQUIREMENTS_TXT OUR_WHEEL... (platform flags from $PIP_TARGET_FLAGS)
Writes OUT_REQUIREMENTS_TXT (what the folder holds) and `box-provided.txt` beside it (the resolved
packages the box image provides, pinned: tests install them to emulate the image).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path

HERE = Path(__file__).resolve().parent
BOX_IMAGE = HERE / "box_image.txt"
"""The image's package list (one `name` or `name==version` a line, `#` comments)."""
TORCH_DEPS = ("filelock", "typing-extensions>=4.10.0", "sympy>=1.13.3", "networkx>=2.5.1", "jinja2", "fsspec>=0.8.5",
              "setuptools")
"""torch's own requirements without its CUDA wheels (torch 2.x METADATA)."""
LEFT_OUT: dict[str, str] = {}
"""Requirements of clawbridge the kit does not carry, and why (none now: pyarrow, once left out for
its 54 MiB, is on the image). run.sh installs the pinned list with --no-deps."""


def normalize(name: str) -> str:
    """PEP 503 name normalization."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_box_image(path: Path = BOX_IMAGE) -> dict[str, str | None]:
    """{normalized name (or a `prefix-*` pattern): known version or None} from the image list."""
    out: dict[str, str | None] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        out[normalize(name) if not name.endswith("*") else name.lower()] = version.strip() or None
    return out


def on_box(name: str, box: Mapping[str, str | None]) -> bool:
    """Whether the image has `name` (a listed name, or one matching a `prefix-*` pattern)."""
    n = normalize(name)
    return n in box or any(p.endswith("*") and n.startswith(p[:-1]) for p in box)


def lacking(resolved: Mapping[str, str], box: Mapping[str, str | None], own: Iterable[str]) -> list[str]:
    """The pinned requirements of what the resolution needs and the image lacks (sorted)."""
    skip = {normalize(n) for n in own} | {normalize(n) for n in LEFT_OUT}
    return sorted(f"{n}=={v}" for n, v in resolved.items() if not on_box(n, box) and normalize(n) not in skip)


def conflicts(resolved: Mapping[str, str], box: Mapping[str, str | None]) -> dict[str, tuple[str, str]]:
    """Box packages whose known version differs from the one the resolution chose: {name: (box, resolved)}."""
    out = {}
    for n, v in resolved.items():
        known = box.get(normalize(n))
        if known and known != v and not v.startswith(known + "+"):
            out[n] = (known, v)
    return out


def stub_torch(folder: Path, version: str) -> str:
    """Write a metadata-only torch wheel; return the requirement that selects it."""
    version = f"{version}+box"
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


def resolve(reqs: list[str], stub_dir: Path, flags: list[str], no_deps: bool = False) -> dict[str, str]:
    """pip's resolution of `reqs` for the target platform: {normalized name: version}."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--report",
               str(report), "--target", str(Path(tmp) / "t"), "--find-links", str(stub_dir), *flags,
               *(["--no-deps"] if no_deps else []), *reqs]
        subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL if no_deps else None)
        items = json.loads(report.read_text())["install"]
    return {normalize(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def available_pins(box: Mapping[str, str | None], needed: Iterable[str], stub_dir: Path, flags: list[str]) -> list[str]:
    """The image's known versions of the `needed` packages as requirements, each kept only if the
    index has it."""
    pins = []
    wanted = {normalize(n) for n in needed}
    for name, version in box.items():
        if version is None or name.endswith("*") or name == "torch" or name not in wanted:
            continue
        try:
            resolve([f"{name}=={version}"], stub_dir, flags, no_deps=True)
        except subprocess.CalledProcessError:
            print(f"note: {name}=={version} (on the box) is not on this index: resolved unpinned")
            continue
        pins.append(f"{name}=={version}")
    return pins


def main(argv: list[str]) -> int:
    out, wheels = Path(argv[0]), argv[1:]
    flags = shlex.split(os.environ.get("PIP_TARGET_FLAGS", ""))
    box = read_box_image()
    with tempfile.TemporaryDirectory() as tmp:
        torch_req = stub_torch(Path(tmp), os.environ.get("BOX_TORCH_VERSION", box.get("torch") or "2.11.0"))
        loose = resolve([torch_req, *wheels], Path(tmp), flags)  # which box packages the closure reaches
        pins = available_pins(box, loose, Path(tmp), flags)
        ours = resolve([torch_req, *pins, *wheels], Path(tmp), flags)  # with the versions the box has
    clash = conflicts(ours, box)
    if clash:
        print(f"warning: clawbridge needs other versions of box packages: {clash} (the box's are kept)")
    need = lacking(ours, box, ("clawbridge", "clawbridge-local"))
    for name, why in LEFT_OUT.items():
        print(f"left out: {name} ({why})")
    out.write_text("\n".join(need) + "\n")
    provided = sorted(f"{n}=={v}" for n, v in ours.items()
                      if on_box(n, box) and n != "torch" and normalize(n) not in ("clawbridge", "clawbridge-local"))
    (out.parent / "box-provided.txt").write_text("\n".join(provided) + "\n")
    print(f"box image: {len(box)} packages listed ({BOX_IMAGE.name}); clawbridge adds {len(need)}: {' '.join(need)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
