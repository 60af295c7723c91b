"""The notes API (`/rl/notes`): see, add and delete the notes learned from talk (`clawbridge.rewards.notes`).

- GET    /rl/notes[?user=U]        -> {"notes": [{note_id, user, text, status, corrections, sessions_since, ...}]}
- POST   /rl/notes {"text", "user"?} -> the note (a preference said in so many words, as a note)
- DELETE /rl/notes/{note_id}       -> {"note_id", "deleted": true}
- DELETE /rl/notes[?user=U]        -> {"user", "deleted": N}   every note of the user

Who sees what: the admin key every user's notes (`user` picks one; '' or none in POST is the
shared key's); a user's key only their own (another user's note is 404, as if it did not exist);
the plain client key the notes of calls made without a user (the shared key's own); a session key
none (403). Notes off (no judge, or `notes = false`) is 404 `notes_off` on every route.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from clawbridge.proxy.auth import Principal, authenticate
from clawbridge.proxy.errors import ApiError, validated
from clawbridge.proxy.request import parse_json_object, read_body
from clawbridge.proxy.state import ProxyState
from clawbridge.rewards.notes import NoteBook
from clawbridge.store.notes import MAX_NOTE_CHARS

log = logging.getLogger("clawbridge.proxy")


class NewNote(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1, max_length=MAX_NOTE_CHARS)
    user: str | None = None


def _owner(principal: Principal, asked: str | None) -> str | None:
    """Whose notes `principal` reaches: the user it names (admin; None: everyone's), or its own."""
    if principal.kind == "admin":
        return asked
    if principal.kind == "session":
        raise ApiError(403, "a session key cannot see or change notes; use your user key or the client key",
                       code="forbidden")
    if asked is not None and asked != (principal.user or ""):
        raise ApiError(403, "you can only see and change your own notes", code="forbidden", param="user")
    return principal.user or ""


def build_notes_router(state: ProxyState) -> APIRouter:
    router = APIRouter(prefix="/rl/notes")

    def book() -> NoteBook:
        if state.notes is None:
            raise ApiError(404, "notes are off: they come from a judge's hints (set judge, and notes = true)",
                           code="notes_off")
        return state.notes

    @router.get("")
    async def listing(request: Request, user: str | None = None) -> dict[str, Any]:
        principal = await authenticate(request, state.keys, state.store)
        notes = book()
        owner = _owner(principal, user)
        return {"notes": await state.read(notes.status, owner)}

    @router.post("")
    async def add(request: Request) -> dict[str, Any]:
        principal = await authenticate(request, state.keys, state.store)
        notes = book()
        raw = await read_body(request, state.settings.max_body_bytes, state.settings.body_timeout_s)
        req = validated(NewNote, parse_json_object(raw), code="invalid_note", empty_loc="text",
                        message='send {{"text": "..."}}: {loc}: {msg}')
        owner = _owner(principal, req.user) or ""
        note, _ = await state.writer.call(notes.notes.add, owner, req.text, None, notes.config.max_active)
        await state.read(notes.refresh)
        log.info("note %d added by hand for %s", note.note_id, owner or "the shared key")
        return note.as_dict()

    @router.delete("/{note_id}")
    async def delete(request: Request, note_id: int) -> dict[str, Any]:
        principal = await authenticate(request, state.keys, state.store)
        notes = book()
        owner = _owner(principal, None)
        if not await state.writer.call(notes.delete, note_id, owner):
            raise ApiError(404, f"no note {note_id}", code="note_not_found", param="note_id")
        return {"note_id": note_id, "deleted": True}

    @router.delete("")
    async def delete_all(request: Request, user: str | None = None) -> dict[str, Any]:
        principal = await authenticate(request, state.keys, state.store)
        notes = book()
        owner = _owner(principal, user) or ""
        n = await state.writer.call(notes.notes.delete_all, owner)
        await state.read(notes.refresh)
        return {"user": owner or None, "deleted": n}

    return router
