"""The notes API (`/rl/notes`): see, add and delete the notes learned from talk (`clawbridge.rewards.notes`).

- GET    /rl/notes[?user=U]          -> {"notes": [{note_id, user, text, status, corrections, sessions_since, ...}]}
- POST   /rl/notes {"text", "user"?} -> the note (a preference said in so many words, as a note)
- DELETE /rl/notes/{note_id}         -> {"note_id", "deleted": true}
- DELETE /rl/notes[?user=U]          -> {"user", "deleted": N}   every note of the user

Who sees what is the access table's (`clawbridge.access`, resource `notes`): the admin key every
user's notes (`user` picks one; '' or none in POST is the shared key's); a user's key only their
own; the plain client key the notes of calls made without a user (the shared key's own); a session
key none (403). Another user's note, or list, is 404 as if it did not exist. Notes off (`notes =
false`) is 404 `notes_off` on every route.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from clawbridge.access import Principal, Target
from clawbridge.proxy.errors import ApiError, validated
from clawbridge.proxy.ownership import caller, require
from clawbridge.proxy.request import parse_json_object, read_body
from clawbridge.proxy.state import ProxyState
from clawbridge.rewards.notes import NoteBook
from clawbridge.store.notes import MAX_NOTE_CHARS

log = logging.getLogger("clawbridge.proxy")


class NewNote(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1, max_length=MAX_NOTE_CHARS)
    user: str | None = None


def _unknown_note(note_id: int) -> ApiError:
    return ApiError(404, f"no note {note_id}", code="note_not_found", param="note_id")


def _whose(principal: Principal, asked: str | None, action: str) -> str | None:
    """Whose notes the request reaches: the user it names (None: everyone's, for the admin), else
    the caller's own; naming another user's is 404 as for a user with no notes."""
    if asked is None:
        return None if principal.kind == "admin" else (principal.user or "")
    require(principal, "notes", "read" if action == "read" else "write", Target(asked or None),
            lambda: ApiError(404, f"no notes of user {asked!r}", code="note_not_found", param="user"))
    return asked


def build_notes_router(state: ProxyState) -> APIRouter:
    router = APIRouter(prefix="/rl/notes")

    def book() -> NoteBook:
        if state.notes is None:
            raise ApiError(404, "notes are off on this server (notes = false)", code="notes_off")
        return state.notes

    @router.get("")
    async def listing(request: Request, user: str | None = None) -> dict[str, Any]:
        principal = await caller(state, request, "notes", "read")
        notes = book()
        return {"notes": await state.read(notes.status, _whose(principal, user, "read"))}

    @router.post("")
    async def add(request: Request) -> dict[str, Any]:
        principal = await caller(state, request, "notes", "write")
        notes = book()
        raw = await read_body(request, state.settings.max_body_bytes, state.settings.body_timeout_s)
        req = validated(NewNote, parse_json_object(raw), code="invalid_note", empty_loc="text",
                        message='send {{"text": "..."}}: {loc}: {msg}')
        owner = _whose(principal, req.user, "write") or ""
        note, _ = await state.writer.call(notes.notes.add, owner, req.text, None, notes.config.max_active)
        await state.read(notes.refresh)
        log.info("note %d added by hand for %s", note.note_id, owner or "the shared key")
        return note.as_dict()

    @router.delete("/{note_id}")
    async def delete(request: Request, note_id: int) -> dict[str, Any]:
        principal = await caller(state, request, "notes", "write")
        notes = book()
        note = await state.read(notes.notes.get, note_id)
        if note is None:
            raise _unknown_note(note_id)
        require(principal, "notes", "write", Target(note.user_id or None), lambda: _unknown_note(note_id))
        if not await state.writer.call(notes.delete, note_id):
            raise _unknown_note(note_id)
        return {"note_id": note_id, "deleted": True}

    @router.delete("")
    async def delete_all(request: Request, user: str | None = None) -> dict[str, Any]:
        principal = await caller(state, request, "notes", "write")
        notes = book()
        owner = _whose(principal, user, "write")
        if owner is None:
            raise ApiError(422, "name the user whose notes to delete: ?user=NAME ('' for the shared key's)",
                           code="invalid_user", param="user")
        n = await state.writer.call(notes.notes.delete_all, owner)
        await state.read(notes.refresh)
        return {"user": owner or None, "deleted": n}

    return router
