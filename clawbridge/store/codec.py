"""Exact binary encodings for token ids and logprobs stored in SQLite blobs."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence


def encode_ids(ids: Sequence[int]) -> bytes:
    """uint32 little-endian."""
    a = array("I", ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def decode_ids(blob: bytes) -> list[int]:
    a = array("I")
    a.frombytes(blob)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def encode_floats(values: Sequence[float]) -> bytes:
    """float64 little-endian: logprobs are kept bit for bit."""
    a = array("d", values)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def decode_floats(blob: bytes) -> list[float]:
    a = array("d")
    a.frombytes(blob)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()
