"""Loading a causal LM for the torch engine: device and dtype resolution, with a progress bar.

Invariants:
- Nothing is downloaded unless asked: by default a Hugging Face id loads only if it is already in
  the local cache (`local_files_only=True`); a local folder always works.
- `device="auto"` is cuda when available, else cpu; `dtype="auto"` is bfloat16 on cuda and float32
  on cpu. The loaded model is in eval mode on the resolved device.
- Progress bars (ours and transformers') are drawn only when stderr is a terminal: a server
  started with its output in a log file gets no bar frames in it (`bars_on_terminal_only`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from tqdm.auto import tqdm

from clawbridge.sources import resolve_source

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(device: str) -> torch.device:
    """`auto` -> cuda if available else cpu; otherwise `device` as torch understands it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` -> bfloat16 on cuda, float32 elsewhere; otherwise one of the names in `_DTYPES`."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, {', '.join(_DTYPES)}") from None


@contextlib.contextmanager
def bars_on_terminal_only() -> Iterator[None]:
    """transformers' own progress bars (weight loading) off while stderr is not a terminal."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if was and not sys.stderr.isatty():
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def load_causal_lm(
    model: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    local_files_only: bool = True,
    progress: bool = True,
) -> torch.nn.Module:
    """Load `model` (a folder or a cached HF id) as an eval-mode causal LM on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not model:
        raise ValueError("no model given: set --model to a local folder or a cached Hugging Face id")
    source, is_dir = resolve_source(model)
    with bars_on_terminal_only(), tqdm(total=3, desc=f"loading {model}", unit="stage",
                                       disable=None if progress else True) as bar:  # None: not on a non-TTY
        bar.set_postfix_str("config")
        try:
            AutoConfig.from_pretrained(source, local_files_only=local_files_only)
        except OSError as e:
            where = "folder" if is_dir else "Hugging Face id (not in the local cache?)"
            raise ValueError(f"cannot load model {model!r} as a {where}: {e}") from e
        bar.update(1)
        bar.set_postfix_str("weights")
        lm: Any = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local_files_only)
        bar.update(1)
        bar.set_postfix_str(f"to {device}")
        lm = lm.to(device)
        lm.eval()
        bar.update(1)
    model_out: torch.nn.Module = lm
    return model_out
