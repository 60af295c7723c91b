"""Telling a local model folder from a Hugging Face id, with a clear error for a missing folder.

`--model ./my-model` with a typo used to reach the Hub client, which answered with a message about
repo id syntax. A value that is written as a path (absolute, `./`, `../`, `~`) and is not a folder
is now reported as a missing folder before anything tries to load it.
"""

from __future__ import annotations

from pathlib import Path


def looks_like_path(value: str) -> bool:
    """True for values a user wrote as a filesystem path rather than an `org/name` id."""
    return value.startswith(("/", ".", "~")) or "\\" in value


def resolve_source(value: str, what: str = "model") -> tuple[str, bool]:
    """`(source, is_local_folder)` for `value`; ValueError when a path names no folder."""
    path = Path(value).expanduser()
    if path.is_dir():
        return str(path), True
    if looks_like_path(value) or path.is_file():
        why = "is a file, not a folder" if path.is_file() else "does not exist"
        raise ValueError(f"{what} folder {value!r} {why}; pass a model folder (config.json, tokenizer) "
                         "or a Hugging Face id such as Qwen/Qwen3-8B")
    return value, False
