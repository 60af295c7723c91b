"""Build hook: the `clawbridge` wheel carries the built OpenClaw extension.

Everything else about the package is in pyproject.toml. The extension's one source is
`extensions/openclaw/` (an npm package of its own); `build_py` copies its built files
(`clawbridge.openclaw.installer.EXTENSION_FILES`) into `clawbridge/openclaw/extension/` of the
build, so `clawbridge openclaw install` finds them in a wheel installed anywhere (pip, pipx, uv).

Invariants:
- A wheel or sdist built without those files fails the build (never a wheel that cannot install
  the extension). An editable install copies nothing: it reads `extensions/openclaw/` in place.
- The sdist carries `extensions/openclaw/` (MANIFEST.in), so a wheel built from it has them too.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
EXTENSION_SOURCE = ROOT / "extensions" / "openclaw"
EXTENSION_FILES = ("package.json", "openclaw.plugin.json", "index.js")
"""The same list as `clawbridge.openclaw.installer.EXTENSION_FILES` (tests/test_wheels.py checks)."""
PACKAGED_AT = ("clawbridge", "openclaw", "extension")


class BuildPyWithExtension(build_py):
    """build_py, plus the OpenClaw extension's built files as package data of clawbridge.openclaw."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        missing = [name for name in EXTENSION_FILES if not (EXTENSION_SOURCE / name).is_file()]
        if missing:
            raise SystemExit(f"cannot build clawbridge: {EXTENSION_SOURCE} lacks {missing}")
        dest = Path(self.build_lib, *PACKAGED_AT)
        dest.mkdir(parents=True, exist_ok=True)
        for name in EXTENSION_FILES:
            shutil.copyfile(EXTENSION_SOURCE / name, dest / name)


setup(cmdclass={"build_py": BuildPyWithExtension})
