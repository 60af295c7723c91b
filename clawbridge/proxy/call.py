"""The one sample-and-record path every API shape (chat completions, messages, responses) runs on.

A `SampledCall` renders OpenAI-shaped messages to prompt ids, samples, and records the turn; an
`ApiShape` (one per API) only turns what was sampled into that API's body or event stream.

Invariants:
- Token exact: the prompt ids recorded are the ids given to the sampler; the completion ids and
  logprobs recorded are those the sampler yielded, stop token included. Text sent to the client is
  decoded from those ids; nothing is re-tokenized.
- A turn is committed to the store before the last byte of its response is sent: for a stream,
  before the shape's `closing()` events (the ones that say the answer is finished); otherwise
  before the JSON body.
- A call whose client goes away is cancelled at the sampler and recorded with status `cancelled`
  (never trained on), so nothing is silently dropped: while the call waits for its stream to start
  (`sample()` waits until the engine admits it, e.g. SGLang's first chunk), and for a stream however
  its response ends, even one that never sent a byte (`CallStreamingResponse`). A call is recorded
  once (`settled`).
- A turn that cannot be recorded is never answered as a success: a whole response becomes the
  store's 507/503 error, a stream ends with an error event instead of its closing events.
- On shutdown (`state.drain`), calls still running when the grace period ends are cancelled,
  recorded `cancelled`, and answered 503 (or an error event).
- A call whose user is forgotten while it runs (`clawbridge.proxy.inflight`: its ticket is cut)
  stops sampling at once, records nothing (not even `cancelled`), and is answered 401
  `user_forgotten` (or that error event); every turn carries its caller and the forget epoch its
  call began in, so the store refuses it anyway (`clawbridge.store.tombstones`).
- Every id a client sees for a call (`chatcmpl-<hex>`, `msg_<hex>`, `resp_<hex>`) and the turn id
  in the store (`turn_<hex>`) share one hex part, so `turn_id_for` maps any of them to the turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from clawbridge.access import Denied, Principal
from clawbridge.chat.chatformat import Prompt, ToolChoiceError
from clawbridge.chat.messages import Messages
from clawbridge.chat.parse import TOOL_CLOSE, IncrementalDecoder, ParsedMessage, StreamParser
from clawbridge.chat.render import RenderError
from clawbridge.proxy.errors import ApiError, denied
from clawbridge.proxy.inflight import Ticket, forgotten_error
from clawbridge.proxy.request import ChatRequest
from clawbridge.proxy.sessions import CallSession
from clawbridge.proxy.state import ProxyState
from clawbridge.proxy.stops import StopMatcher
from clawbridge.rewards.notes import (
    CHECK_META,
    NOTES_HEADER,
    echoes_note,
    note_hint,
    noted_messages,
)
from clawbridge.serving.best_of import best_of, can_pick
from clawbridge.serving.sampler import (
    PromptTooLong,
    SampledToken,
    Sampler,
    SamplerError,
    SamplerOverloaded,
    SamplerTimeout,
    SamplerUnavailable,
    SampleStream,
    SamplingParams,
)
from clawbridge.serving.versions import VersionNotFound, parse_versioned
from clawbridge.store import TurnRecord
from clawbridge.store.notes import ECHO_META, Note
from clawbridge.store.tombstones import UserForgotten

log = logging.getLogger("clawbridge.proxy")

CLIENT_ID_PREFIXES = ("chatcmpl-", "msg_", "resp_", "turn_")
"""Prefixes of the ids a call is known by; the rest of the id is the call's hex part."""


def shutting_down() -> ApiError:
    """How a call still running when the drain grace period ends is answered (recorded cancelled)."""
    return ApiError(503, "clawbridge is shutting down and this call did not finish within drain_grace_s; retry it",
                    code="server_shutting_down", headers={"Retry-After": "5"})


def turn_id_for(interaction_id: str) -> str:
    """The store's turn id for any id a client received for a call (or the turn id itself)."""
    for prefix in CLIENT_ID_PREFIXES:
        if interaction_id.startswith(prefix) and len(interaction_id) > len(prefix):
            return "turn_" + interaction_id[len(prefix):]
    return interaction_id


def sampler_error(exc: SamplerError) -> ApiError:
    """Map a sampler failure to the status the client sees."""
    if isinstance(exc, SamplerOverloaded):
        retry = max(1, round(exc.retry_after_s))
        return ApiError(429, f"model is busy: {exc}; retry after {retry}s", code="overloaded",
                        headers={"Retry-After": str(retry)})
    if isinstance(exc, PromptTooLong):
        return ApiError(400, str(exc), code="context_length_exceeded", param="messages")
    if isinstance(exc, SamplerTimeout):
        return ApiError(504, f"model timed out: {exc}", code="model_timeout")
    if isinstance(exc, SamplerUnavailable):
        return ApiError(502, f"model unreachable: {exc}", code="model_unreachable")
    return ApiError(502, f"model failed: {exc}", code="model_error")


@dataclass
class Generation:
    """What has been sampled so far for one call, and the text made from it."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tokens: list[SampledToken] = field(default_factory=list)
    text: str = ""
    first_token_at: float | None = None
    finish_reason: str | None = None


class ApiShape(Protocol):
    """One API's view of a `SampledCall`: its response body, or its event stream.

    Stream order: `opening()`, then `piece()` per piece of released text, then `flush()`; the
    turn is recorded with `recorded()`; then `closing()` (the events that end the answer).

    Tested like `model_routes.ApiAdapter` (the real SDKs over `tests/fake_proxy`).
    """

    def body(self) -> dict[str, Any]:
        """The whole response, from `call.gen` once sampling ended (also what is recorded)."""
        ...

    def opening(self) -> list[bytes]: ...

    def piece(self, text: str, tokens: list[SampledToken]) -> list[bytes]: ...

    def flush(self) -> list[bytes]: ...

    def recorded(self) -> dict[str, Any]:
        """The response object recorded for a finished stream (equal to `body()` ids aside)."""
        ...

    def closing(self) -> list[bytes]: ...

    def stream_error(self, err: ApiError) -> bytes:
        """The event that reports `err` mid-stream."""
        ...


async def route_sampler(state: ProxyState, model: str, session_id: str | None, by: Principal) -> Sampler:
    """The sampler `state.router` picks for `model` (`NAME@N`, or the served name) in `session_id`
    for caller `by`; 404 `model_not_found` naming the versions kept when `NAME@N` cannot be served
    (or is another user's), 403 for the admin naming a user's version."""
    try:
        return (await state.router.route(model, session_id, by)).sampler
    except Denied as exc:
        raise denied(exc) from None
    except VersionNotFound as exc:
        if parse_versioned(model, state.router.model_names) is None:
            # A plain request is never refused because the serving version cannot be loaded (a
            # backend that serves one version at a time): the published one answers, said in the log.
            log.error("the serving version cannot be served (%s); the published v%d answers", exc,
                      state.router.published_version)
            return state.backend.sampler()
        kept = ", ".join(f"{state.model_info.name}@{v}" for v in exc.kept) or "none"
        raise ApiError(404, f"{exc}; versions kept: {kept}", code="model_not_found", param="model") from None
    except SamplerError as exc:
        raise sampler_error(exc) from None


def render_request(state: ProxyState, messages: Messages,
                   tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> Prompt:
    """The prompt for a chat request's parsed `messages` (plain message objects are parsed first),
    `tools` and `tool_choice`; a 400 naming the problem if it cannot be rendered."""
    try:
        return state.renderer.render_prompt(messages, tools, tool_choice)
    except ToolChoiceError as exc:
        raise ApiError(400, f"invalid tool_choice: {exc}", code="invalid_tool_choice", param="tool_choice") from None
    except RenderError as exc:
        raise ApiError(400, f"cannot render messages: {exc}", code="invalid_messages") from None


class SampledCall:
    """One model call, from the normalised request (`ChatRequest` + OpenAI-shaped data) to the turn."""

    def __init__(self, state: ProxyState, req: ChatRequest, data: dict[str, Any], stored: str,
                 call: CallSession, *, with_history: bool = False, ticket: Ticket | None = None) -> None:
        """`stored`: the request as recorded (`clawbridge.proxy.request.stored_request`);
        `with_history`: `data` holds stored turns too (previous_response_id), so its size is not
        the body's and it is rendered off the loop whatever the body's size; `ticket`: the
        request's (`clawbridge.proxy.inflight`), identified as the caller's."""
        self.ticket = ticket if ticket is not None else Ticket(state.store.tombstones.epoch)
        self._closing: asyncio.Task[None] | None = None
        self.with_history = with_history
        self.state = state
        self.req = req
        self.data = data
        self.stored = stored
        self.call = call
        self.created = state.store.clock.now()  # a turn's times are the store's clock, like every row
        self.hex = uuid.uuid4().hex
        self.gen = Generation()
        self.prompt: Prompt | None = None
        """The rendered prompt (after `start`): its ids, and any forced call its end opens."""
        self.prompt_ids: list[int] = []
        self.train_prompt_ids: list[int] | None = None
        """The prompt without the user's notes when the call carried some (`clawbridge.rewards.notes`)."""
        self.notes_meta: list[int] | str | None = None
        """The ids of the notes the call carried, 'check' for a check session, or None."""
        self.hint: str | None = None
        """The notes' text the call carried (None without notes)."""
        self.note_texts: list[str] = []
        """Each note the call carried, oldest first (what the judge checks its answers against)."""
        self.notes_off = False
        """`X-Clawbridge-Notes: off`: serve this call without notes."""
        self.best_of: dict[str, object] | None = None
        """What the call was picked from when it was served best of n (`clawbridge.serving.best_of`)."""
        self._stream_parser: StreamParser | None = None
        self.policy_version = 0
        self.stream: SampleStream | None = None
        self._decoder = IncrementalDecoder(state.renderer.decode)
        self._stops = StopMatcher(req.stop_strings)
        self._stop_ids = set(state.renderer.stop_token_ids)
        self.settled = False
        """The turn was recorded (or its recording was attempted): it is never recorded again."""

    @property
    def turn_id(self) -> str:
        return "turn_" + self.hex

    # ------------------------------------------------------------------ set-up
    def params(self) -> SamplingParams:
        info = self.state.model_info
        req = self.req
        asked = req.max_completion_tokens or req.max_tokens or info.max_output_tokens
        room = info.context_window - len(self.prompt_ids)
        if room < 1:
            raise ApiError(400, f"prompt is {len(self.prompt_ids)} tokens; the model's context is "
                           f"{info.context_window}", code="context_length_exceeded", param="messages")
        return SamplingParams(
            max_tokens=min(asked, room),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            seed=req.seed,
            stop_token_ids=tuple(self.state.renderer.stop_token_ids),
            top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
        )

    async def start(self) -> None:
        # Rendering and tokenizing grow with the prompt: off the loop when it is large.
        req = self.req
        notes, check = self.notes()
        self.hint = note_hint(notes) if notes and self.state.notes is not None else None
        self.note_texts = [n.text for n in notes] if self.hint is not None else []
        messages = (noted_messages(req.messages, self.hint, self.state.notes.config.place)
                    if self.hint is not None and self.state.notes is not None else req.messages)
        self.prompt = await self.state.compute(len(self.stored), render_request, self.state, messages,
                                               req.tools, req.tool_choice, reads_store=self.with_history)
        self.prompt_ids = self.prompt.ids
        if notes:  # what the model sees carries the notes; what it trains on is the call without them
            plain = await self.state.compute(len(self.stored), render_request, self.state, req.messages,
                                             req.tools, req.tool_choice, reads_store=self.with_history)
            self.train_prompt_ids = plain.ids
            self.notes_meta = [n.note_id for n in notes]
        elif check:
            self.notes_meta = CHECK_META
        if self.prompt.forced is not None or (self.req.parallel_tool_calls is False and self.data.get("tools")):
            # A forced call is the whole answer (as OpenAI answers a named tool_choice), and with
            # parallel_tool_calls false the first call is the last: sampling ends where it closes.
            self._stops = StopMatcher(self.req.stop_strings, ends=[TOOL_CLOSE])
        params = self.params()
        self.state.writer.ensure_recordable(self.state.settings.min_free_disk_bytes)
        sampler = await route_sampler(self.state, self.req.model, self.call.session_id, self.call.principal)
        if self.ticket.cut:
            raise forgotten_error()
        n = self.state.notes.config.best_of if self.hint is not None and self.state.notes is not None else 1
        try:
            if self.train_prompt_ids is not None and can_pick(sampler, params, n):
                self.stream = await self.sample_best_of(sampler, params, n)
            else:
                self.stream = await sampler.sample(self.prompt_ids, params)
        except SamplerError as exc:
            raise sampler_error(exc) from None
        self.policy_version = self.stream.policy_version
        self.ticket.on_cut(self._close_stream)  # forgotten while it runs: the sampler stops now

    async def sample_best_of(self, sampler: Sampler, params: SamplingParams, n: int) -> SampleStream:
        """The noted call's answer, best of `n` (`clawbridge.serving.best_of`): its candidates stop
        when the user is forgotten (401) or `request_timeout_s` passes (504), like one stream."""
        hint, plain = self.hint, self.train_prompt_ids
        assert hint is not None and plain is not None
        stops = self._stop_ids
        more = self.state.notes.config.best_of_more if self.state.notes is not None else 0

        def text(ids: list[int]) -> str:
            return str(self.state.renderer.decode([i for i in ids if i not in stops]))

        def echoes(ids: list[int]) -> bool:
            return echoes_note(text(ids), hint)

        checker, follows = self.state.note_checker, None
        if checker is not None:
            asked = next((m.content for m in reversed(self.req.messages) if m.role == "user"), "")
            follows = checker.for_call(self.note_texts, asked, text)
        task = asyncio.ensure_future(asyncio.wait_for(
            best_of(sampler, self.prompt_ids, plain, params, n, echoes, follows, more),
            self.state.settings.request_timeout_s))

        def stop() -> None:  # the user is forgotten: every candidate stops now
            task.cancel()

        self.ticket.on_cut(stop)
        try:
            chosen = await task
        except asyncio.CancelledError:
            if self.ticket.cut and not _cancelling():
                raise forgotten_error() from None
            raise
        except TimeoutError:
            raise SamplerTimeout("best of n for a noted call did not finish within request_timeout_s") from None
        self.best_of = chosen.meta()
        return chosen.stream

    def _close_stream(self) -> None:
        if self.stream is not None and self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self.stream.aclose())

    def notes(self) -> tuple[list[Note], bool]:
        """The user's notes this call carries, and whether it is a check session (module rules of
        `clawbridge.rewards.notes`): none for a `NAME@N` call or one that turned them off."""
        book = self.state.notes
        if book is None or self.notes_off or parse_versioned(self.req.model, self.state.router.model_names) is not None:
            return [], False
        return book.for_call(self.call.user, self.call.session_id, self.call.turn_type)

    def parser(self) -> StreamParser:
        """A new parser for this call's completion: the chat format's, continuing any forced call."""
        assert self.prompt is not None, "parser() before start()"
        return self.state.renderer.parser(self.prompt)

    @property
    def stream_parser(self) -> StreamParser:
        """The parser the streamed pieces go through (one per call, made once the prompt is rendered)."""
        if self._stream_parser is None:
            self._stream_parser = self.parser()
        return self._stream_parser

    def parsed(self) -> ParsedMessage:
        """Everything sampled so far, parsed as one assistant message."""
        return self.state.renderer.parse(self.gen.text, self.prompt)

    # ------------------------------------------------------------------ sampling
    async def pieces(self) -> AsyncIterator[tuple[str, list[SampledToken]]]:
        """Decoded text as it becomes certain, with the tokens it came from."""
        assert self.stream is not None
        gen = self.gen
        pending: list[SampledToken] = []
        async for tok in self.stream:
            if gen.first_token_at is None:
                gen.first_token_at = self.state.store.clock.now()
            gen.ids.append(tok.token_id)
            gen.logprobs.append(tok.logprob)
            gen.tokens.append(tok)
            pending.append(tok)
            if tok.token_id in self._stop_ids:
                continue
            text, hit = self._stops.push(self._decoder.push(tok.token_id))
            if text:
                gen.text += text
                yield text, pending
                pending = []
            if hit:
                gen.finish_reason = "stop"
                await self.stream.aclose()
                return
        tail, _ = self._stops.push(self._decoder.flush())
        tail += self._stops.flush()
        gen.text += tail
        if tail or pending:
            yield tail, pending
        gen.finish_reason = self.stream.finish_reason or "stop"

    def matched_stop(self) -> str | None:
        """The stop string that ended sampling, if one did."""
        if self.gen.finish_reason != "stop" or not self.req.stop_strings:
            return None
        # The matched stop string starts right where the released text ends.
        full = self.state.renderer.decode(self.gen.ids)
        at = len(self.gen.text)
        return next((s for s in self.req.stop_strings if full.startswith(s, at)), None)

    # ------------------------------------------------------------------ recording
    def turn(self, status: str, response_json: str | None) -> TurnRecord:
        """The turn as recorded; `response_json`: the response body already serialized (once: the
        client gets the same bytes)."""
        meta = dict(self.call.meta)
        meta["stream"] = self.req.stream
        if self.notes_meta is not None:
            meta["notes"] = self.notes_meta
        if self.best_of is not None:
            meta["best_of"] = self.best_of
        if self.hint is not None and echoes_note(self.gen.text, self.hint):
            meta[ECHO_META] = True  # never trained (`clawbridge.rewards.notes`)
        return TurnRecord(
            session_id=self.call.session_id, turn_type=self.call.turn_type, status=status,
            model=self.state.model_info.name, prompt_token_ids=self.prompt_ids,
            completion_token_ids=self.gen.ids, completion_logprobs=self.gen.logprobs,
            policy_version=self.policy_version,
            finish_reason=self.gen.finish_reason if status == "ok" else status,
            request_json=self.stored,
            response_json=response_json,
            created_at=self.created, completed_at=self.state.store.clock.now(), first_token_at=self.gen.first_token_at,
            meta=meta, turn_id=self.turn_id, user_id=self.call.user, caller=self.call.user,
            epoch=self.ticket.epoch, train_prompt_token_ids=self.train_prompt_ids,
        )

    async def record(self, status: str, response_json: str | None) -> None:
        """Record the turn; 401 `user_forgotten` (nothing recorded) when its user was forgotten."""
        self.settled = True
        if self.ticket.cut:
            raise forgotten_error()
        end = self.call.end_after if status == "ok" else ("single_call" if self.call.source == "implicit" else None)
        try:
            await self.state.writer.record_turn(self.turn(status, response_json), self.call.source, end)
        except UserForgotten:
            raise forgotten_error() from None

    def record_cancelled_soon(self) -> None:
        """Record a call the client abandoned without awaiting (we may be inside a cancelled scope),
        and close its stream; nothing when the call is already recorded or never rendered a prompt
        (nothing was sampled), and nothing for a call whose user is being forgotten."""
        if self.settled or self.prompt is None:
            return
        self.settled = True
        if self.stream is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().create_task(self.stream.aclose())
        if self.ticket.cut:
            return
        self.gen.finish_reason = "cancelled"
        self.state.writer.record_turn_nowait(self.turn("cancelled", None), self.call.source,
                                             "single_call" if self.call.source == "implicit" else None)

    # ------------------------------------------------------------------ non-streaming
    async def complete(self, request: Request, shape: ApiShape) -> Response:
        """Sample to the end, record the turn, then answer `shape.body()` as JSON."""
        abandoned = await self.sample_all(request)
        if abandoned is not None:
            return abandoned
        body = orjson.dumps(shape.body())  # serialized once: the store keeps the bytes the client gets
        await self.record("ok", body.decode())
        return Response(body, media_type="application/json")

    async def sample_all(self, request: Request) -> Response | None:
        """Sample to the end; a 499 response if the client left (the call is recorded cancelled).

        Sampler failures and the request timeout raise `ApiError` (also recorded cancelled).
        """

        async def run() -> None:
            async for _ in self.pieces():
                pass

        task = asyncio.ensure_future(run())
        deadline = time.monotonic() + self.state.settings.request_timeout_s
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    break
                if await request.is_disconnected():
                    task.cancel()
                    self.record_cancelled_soon()
                    return Response(status_code=499)
                if time.monotonic() > deadline:
                    task.cancel()
                    self.record_cancelled_soon()
                    raise ApiError(504, "model did not finish within request_timeout_s", code="model_timeout")
                if self.state.drain.expired.is_set():
                    task.cancel()
                    self.record_cancelled_soon()
                    raise shutting_down()
            exc = task.exception()
            if exc is not None:
                self.record_cancelled_soon()
                if isinstance(exc, SamplerError):
                    raise sampler_error(exc)
                raise exc
        except asyncio.CancelledError:
            task.cancel()
            self.record_cancelled_soon()
            raise
        return None

    # ------------------------------------------------------------------ streaming
    async def events(self, shape: ApiShape) -> AsyncIterator[bytes]:
        """The shape's event stream; the turn is recorded before `shape.closing()`."""
        finished = False
        deadline = time.monotonic() + self.state.settings.request_timeout_s
        try:
            for event in shape.opening():
                yield event
            async for text, toks in self.pieces():
                if self.ticket.cut:
                    raise forgotten_error()
                for event in shape.piece(text, toks):
                    yield event
                if time.monotonic() > deadline:
                    raise SamplerTimeout("request_timeout_s exceeded while streaming")
                if self.state.drain.expired.is_set():
                    raise shutting_down()
            for event in shape.flush():
                yield event
            await self.record("ok", orjson.dumps(shape.recorded()).decode())
            finished = True
            for event in shape.closing():
                yield event
        except SamplerError as exc:
            log.warning("stream %s failed: %s", self.turn_id, exc)
            self.record_cancelled_soon()
            finished = True
            yield shape.stream_error(sampler_error(exc))
        except ApiError as err:  # shutting down, or the turn could not be recorded
            log.warning("stream %s ended: %s", self.turn_id, err.message)
            if err.code == "server_shutting_down":
                self.record_cancelled_soon()
            finished = True
            yield shape.stream_error(err)
        finally:
            if not finished:
                self.record_cancelled_soon()

    def streaming_response(self, shape: ApiShape) -> StreamingResponse:
        return CallStreamingResponse(self, shape)

    async def respond(self, request: Request, shape: ApiShape) -> Response:
        """Start sampling, then answer streamed or whole as the request asked; a 499 (the call
        recorded cancelled) when the client leaves before its stream starts."""
        self.notes_off = request.headers.get(NOTES_HEADER, "").strip().lower() in ("off", "0", "false", "no")
        left = await self.start_watched(request)
        if left is not None:
            return left
        if self.req.stream:
            return self.streaming_response(shape)
        return await self.complete(request, shape)

    async def start_watched(self, request: Request) -> Response | None:
        """`start()`, cancelled when the client goes away meanwhile (a sampler's `sample()` may wait
        for the engine to admit the call); then the 499 response, the call recorded cancelled."""
        task = asyncio.ensure_future(self.start())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    task.result()  # its ApiError, or any failure, as raised by start()
                    return None
                if await request.is_disconnected():
                    task.cancel()
                    await asyncio.wait({task})
                    self.record_cancelled_soon()
                    return Response(status_code=499)
        except asyncio.CancelledError:
            task.cancel()
            self.record_cancelled_soon()
            raise


def _cancelling() -> bool:
    """Whether the running task itself is being cancelled (not only a task it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


DISCONNECT_POLL_S = 0.25
"""How often a call waiting for its sampler checks whether its client is still there."""


class CallStreamingResponse(StreamingResponse):
    """A call's event stream (`SampledCall.events`) that settles the call however the response ends:
    when the server finds the client gone before the first event was taken (an ASGI 2.4 server
    raises from the first `send`; the events never run, so their own cleanup never does), the
    stream is closed at the sampler and the call recorded cancelled."""

    def __init__(self, call: SampledCall, shape: ApiShape) -> None:
        super().__init__(call.events(shape), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Policy-Version": str(call.policy_version)})
        self.call = call

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.call.record_cancelled_soon()  # nothing once the events recorded the turn
