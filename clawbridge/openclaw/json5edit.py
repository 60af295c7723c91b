"""A small JSON5 reader and comment-preserving editor, for editing `openclaw.json` in place.

Invariants:
- Every edit is a splice of the original text: bytes outside the edited member (comments, key
  quoting, number formats, blank lines, trailing commas) are kept exactly.
- Edits address object members by a path of keys (`["plugins", "load", "paths"]`); array items by
  value. Missing intermediate objects are created by the edit that needs them.
- Inserted values are written as JSON (a subset of JSON5), indented like their neighbours.
- `loads(text)` accepts what OpenClaw's JSON5 parser accepts for config files: comments, trailing
  commas, single-quoted strings, unquoted identifier keys, hex / signed / leading-dot numbers,
  Infinity and NaN. An empty or whitespace-only file reads as `{}`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class Json5Error(ValueError):
    """The text is not valid JSON5 (message names the line and column)."""


MISSING: Any = object()
"""Returned by `get` for a path that does not exist."""

_IDENT_RE = re.compile(r"[A-Za-z_$][A-Za-z0-9_$]*")
_NUMBER_RE = re.compile(
    r"[+-]?(?:0[xX][0-9a-fA-F]+|Infinity|NaN|(?:\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?))"
)
_WS = " \t\n\r\v\f\u00a0\u2028\u2029\ufeff"
_ESCAPES = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "0": "\0"}


@dataclass
class Node:
    """A parsed value and its span [start, end) in the text."""

    start: int
    end: int


@dataclass
class Scalar(Node):
    value: Any = None


@dataclass
class Entry:
    """An object member (with key) or an array item (key None). `start` is where it begins."""

    start: int
    key: str | None
    quoted: bool
    value: Node


@dataclass
class Container(Node):
    kind: str = "object"  # "object" | "array"
    entries: list[Entry] = field(default_factory=list)


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def error(self, message: str, pos: int | None = None) -> Json5Error:
        p = self.pos if pos is None else pos
        line = self.text.count("\n", 0, p) + 1
        col = p - (self.text.rfind("\n", 0, p) + 1) + 1
        return Json5Error(f"{message} at line {line}, column {col}")

    def skip(self) -> None:
        self.pos = skip_trivia(self.text, self.pos, self.error)

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def value(self) -> Node:
        self.skip()
        ch = self.peek()
        start = self.pos
        if ch == "{":
            return self.container("object", "}")
        if ch == "[":
            return self.container("array", "]")
        if ch and ch in "\"'":
            text = self.string()
            return Scalar(start, self.pos, text)
        m = _NUMBER_RE.match(self.text, self.pos)
        if m:
            self.pos = m.end()
            return Scalar(start, self.pos, _number(m.group(0)))
        m = _IDENT_RE.match(self.text, self.pos)
        if m and m.group(0) in ("true", "false", "null"):
            self.pos = m.end()
            return Scalar(start, self.pos, {"true": True, "false": False, "null": None}[m.group(0)])
        raise self.error(f"unexpected {ch!r}" if ch else "unexpected end of input")

    def container(self, kind: str, close: str) -> Container:
        node = Container(self.pos, -1, kind)
        self.pos += 1
        while True:
            self.skip()
            if self.peek() == close:
                self.pos += 1
                node.end = self.pos
                return node
            start = self.pos
            key: str | None = None
            quoted = False
            if kind == "object":
                if self.peek() and self.peek() in "\"'":
                    key, quoted = self.string(), True
                else:
                    m = _IDENT_RE.match(self.text, self.pos)
                    if not m:
                        raise self.error("expected a key")
                    key, self.pos = m.group(0), m.end()
                self.skip()
                if self.peek() != ":":
                    raise self.error("expected ':'")
                self.pos += 1
            node.entries.append(Entry(start, key, quoted, self.value()))
            self.skip()
            if self.peek() == ",":
                self.pos += 1
            elif self.peek() != close:
                raise self.error(f"expected ',' or '{close}'")

    def string(self) -> str:
        quote = self.text[self.pos]
        self.pos += 1
        out: list[str] = []
        while True:
            if self.pos >= len(self.text):
                raise self.error("unterminated string")
            ch = self.text[self.pos]
            self.pos += 1
            if ch == quote:
                return "".join(out)
            if ch == "\n":
                raise self.error("newline in string", self.pos - 1)
            if ch != "\\":
                out.append(ch)
                continue
            esc = self.text[self.pos : self.pos + 1]
            self.pos += 1
            if esc in _ESCAPES:
                out.append(_ESCAPES[esc])
            elif esc in ("u", "x"):
                width = 4 if esc == "u" else 2
                digits = self.text[self.pos : self.pos + width]
                if len(digits) != width or not all(c in "0123456789abcdefABCDEF" for c in digits):
                    raise self.error("bad escape")
                out.append(chr(int(digits, 16)))
                self.pos += width
            elif esc == "\r":
                if self.text[self.pos : self.pos + 1] == "\n":
                    self.pos += 1
            elif esc in ("\n", "\u2028", "\u2029"):
                pass  # line continuation
            else:
                out.append(esc)


def _number(token: str) -> int | float:
    sign = -1 if token.startswith("-") else 1
    body = token.lstrip("+-")
    if body == "Infinity":
        return sign * math.inf
    if body == "NaN":
        return math.nan
    if body[:2] in ("0x", "0X"):
        return sign * int(body, 16)
    if re.fullmatch(r"\d+", body):
        return sign * int(body)
    return sign * float(body)


def skip_trivia(text: str, pos: int, error: Any = None) -> int:
    """The first position at or after `pos` that is not whitespace or a comment."""
    n = len(text)
    while pos < n:
        ch = text[pos]
        if ch in _WS:
            pos += 1
        elif text.startswith("//", pos):
            nl = text.find("\n", pos)
            pos = n if nl < 0 else nl + 1
        elif text.startswith("/*", pos):
            close = text.find("*/", pos + 2)
            if close < 0:
                if error is not None:
                    raise error("unterminated comment", pos)
                return n
            pos = close + 2
        else:
            break
    return pos


def parse(text: str) -> Container:
    """Parse a JSON5 document whose top level is an object."""
    if text.strip(_WS) == "":
        return Container(0, 0, "object")  # empty file: an empty object with no text yet
    p = _Parser(text)
    root = p.value()
    p.skip()
    if p.pos != len(text):
        raise p.error("unexpected text after the document")
    if not isinstance(root, Container) or root.kind != "object":
        raise Json5Error("the top level of the config must be an object")
    return root


def to_python(node: Node) -> Any:
    if isinstance(node, Container):
        if node.kind == "array":
            return [to_python(e.value) for e in node.entries]
        return {e.key: to_python(e.value) for e in node.entries}
    assert isinstance(node, Scalar)
    return node.value


def loads(text: str) -> Any:
    """Parse JSON5 text to Python values."""
    return to_python(parse(text))


def _find(root: Container, path: Sequence[str]) -> tuple[Node | None, int]:
    """The node at `path`, or (deepest existing object, how many path parts it covers)."""
    node: Node = root
    for i, part in enumerate(path):
        if not (isinstance(node, Container) and node.kind == "object"):
            raise Json5Error(f"{'.'.join(path[:i])} is not an object")
        entry = _member(node, part)
        if entry is None:
            return node, i
        node = entry.value
    return node, len(path)


def _member(obj: Container, key: str) -> Entry | None:
    found = None
    for entry in obj.entries:
        if entry.key == key:
            found = entry  # JSON5: the last duplicate wins
    return found


def get(text: str, path: Sequence[str]) -> Any:
    """The value at `path`, or MISSING."""
    node, depth = _find(parse(text), path)
    return to_python(node) if node is not None and depth == len(path) else MISSING


def source(text: str, path: Sequence[str]) -> str | None:
    """The exact source text of the value at `path` (comments inside it included), or None."""
    node, depth = _find(parse(text), path)
    return text[node.start : node.end] if node is not None and depth == len(path) else None


def replace_source(text: str, path: Sequence[str], raw: str) -> str:
    """Replace the value at `path` with `raw` JSON5 text (as captured by `source`)."""
    node, depth = _find(parse(text), path)
    if node is None or depth != len(path):
        raise Json5Error(f"{'.'.join(path)} does not exist")
    edited = text[: node.start] + raw + text[node.end :]
    parse(edited)
    return edited


# ---------------------------------------------------------------------------- text layout helpers
def _line_start(text: str, pos: int) -> int:
    return text.rfind("\n", 0, pos) + 1


def _indent_of_line(text: str, pos: int) -> str:
    start = _line_start(text, pos)
    m = re.match(r"[ \t]*", text[start:])
    return m.group(0) if m else ""


def _starts_line(text: str, pos: int) -> bool:
    return text[_line_start(text, pos) : pos].strip(" \t") == ""


def _indent_unit(text: str) -> str:
    widths = [len(m.group(1)) for m in re.finditer(r"\n( +)\S", text)]
    if "\n\t" in text and not widths:
        return "\t"
    return " " * min(widths) if widths else "  "


def _dump(value: Any, indent: str, unit: str, inline: bool) -> str:
    if inline:
        return json.dumps(value, ensure_ascii=False)
    dumped = json.dumps(value, ensure_ascii=False, indent=len(unit) if unit.strip(" ") == "" else unit)
    return dumped.replace("\n", "\n" + indent)


def _format_key(key: str, like: Entry | None) -> str:
    if like is not None and not like.quoted and _IDENT_RE.fullmatch(key):
        return key
    return json.dumps(key, ensure_ascii=False)


def _comma_after(text: str, node: Node) -> int | None:
    p = skip_trivia(text, node.end)
    return p if p < len(text) and text[p] == "," else None


def _insert_entry(text: str, box: Container, key: str | None, value: Any) -> str:
    """Add a member (or array item) at the end of `box`, laid out like its siblings."""
    unit = _indent_unit(text)
    if box.start == box.end:  # empty file
        return "{\n" + unit + _format_key(key or "", None) + ": " + _dump(value, unit, unit, False) + "\n}\n"
    close = box.end - 1
    last = box.entries[-1] if box.entries else None
    prefix = "" if key is None else _format_key(key, last) + ": "
    if last is not None and not _starts_line(text, last.start):
        # Single-line container: `{a: 1}` -> `{a: 1, "k": v}`.
        comma = _comma_after(text, last.value)
        item = prefix + _dump(value, "", unit, True)
        if comma is not None:  # keep the trailing-comma style
            return text[: comma + 1] + " " + item + "," + text[comma + 1 :]
        end = last.value.end
        return text[:end] + ", " + item + text[end:]
    if last is not None:
        indent = _indent_of_line(text, last.start)
    else:
        indent = _indent_of_line(text, close if _starts_line(text, close) else box.start) + unit
    trailing = "," if last is not None and _comma_after(text, last.value) is not None else ""
    item = indent + prefix + _dump(value, indent, unit, False) + trailing
    if _starts_line(text, close) and "\n" in text[box.start : close]:
        at = _line_start(text, close)
        text = text[:at] + item + "\n" + text[at:]
    else:
        closing_indent = _indent_of_line(text, box.start)
        text = text[:close] + "\n" + item + "\n" + closing_indent + text[close:]
    if last is not None and _comma_after(text, last.value) is None:
        text = text[: last.value.end] + "," + text[last.value.end :]
    return text


def _delete_entry(text: str, box: Container, index: int) -> str:
    """Remove one member or item, with its comma and, when it had the line to itself, its line."""
    entry = box.entries[index]
    start, end = entry.start, entry.value.end
    comma = _comma_after(text, entry.value)
    if comma is not None:
        end = comma + 1
    rest = re.match(r"[ \t]*(//[^\n]*)?(\n|$)", text[end:])
    if _starts_line(text, start) and rest is not None:
        start = _line_start(text, start)
        end += rest.end()
    else:
        while start > 0 and text[start - 1] in " \t":
            start -= 1
    text = text[:start] + text[end:]
    if comma is None and index > 0:  # removed the last entry: drop the comma that preceded it
        prev_comma = _comma_after(text, box.entries[index - 1].value)
        if prev_comma is not None:
            text = text[:prev_comma] + text[prev_comma + 1 :]
    return text


# ---------------------------------------------------------------------------- edits
def set_value(text: str, path: Sequence[str], value: Any) -> str:
    """Set the member at `path` to `value`, creating missing parent objects."""
    if not path:
        raise ValueError("empty path")
    root = parse(text)
    node, depth = _find(root, path)
    if depth == len(path):
        assert node is not None
        if to_python(node) == value and type(to_python(node)) is type(value):
            return text
        inline = not _starts_line(text, node.start) and "\n" not in text[node.start : node.end]
        indent = _indent_of_line(text, node.start)
        dumped = _dump(value, indent, _indent_unit(text), inline and not isinstance(value, dict | list))
        return text[: node.start] + dumped + text[node.end :]
    assert isinstance(node, Container)
    nested: Any = value
    for part in reversed(path[depth + 1 :]):
        nested = {part: nested}
    return _insert_entry(text, node, path[depth], nested)


def delete(text: str, path: Sequence[str]) -> str:
    """Remove the member at `path` (no change when it does not exist)."""
    root = parse(text)
    parent, depth = _find(root, path[:-1])
    if (
        parent is None
        or depth != len(path) - 1
        or not isinstance(parent, Container)
        or parent.kind != "object"
    ):
        return text
    for index in range(len(parent.entries) - 1, -1, -1):
        if parent.entries[index].key == path[-1]:
            return delete(_delete_entry(text, parent, index), path)  # also drop earlier duplicates
    return text


def _array_at(text: str, path: Sequence[str]) -> Container | None:
    node, depth = _find(parse(text), path)
    if node is None or depth != len(path):
        return None
    if not (isinstance(node, Container) and node.kind == "array"):
        raise Json5Error(f"{'.'.join(path)} is not an array")
    return node


def append(text: str, path: Sequence[str], item: Any) -> str:
    """Append `item` to the array at `path` unless it is already there (creates the array)."""
    array = _array_at(text, path)
    if array is None:
        return set_value(text, path, [item])
    if any(to_python(e.value) == item for e in array.entries):
        return text
    return _insert_entry(text, array, None, item)


def remove(text: str, path: Sequence[str], item: Any) -> str:
    """Remove every occurrence of `item` from the array at `path`."""
    while True:
        array = _array_at(text, path)
        if array is None:
            return text
        hits = [i for i, e in enumerate(array.entries) if to_python(e.value) == item]
        if not hits:
            return text
        text = _delete_entry(text, array, hits[-1])
