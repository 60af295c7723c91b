"""A small OpenAI-compatible judge endpoint on 127.0.0.1: scripted (tests) or RULE-BASED (demo).

`JudgeServer(answer)` serves `POST /v1/chat/completions` (and `GET /v1/models`) from a thread,
answering each request with `answer(body) -> text`. `rule_based_answer` is a keyword judge for
the prompt `clawbridge.rewards.judge.judge_messages` builds; it is NOT a language model: the demo
labels it as such, and `bench/judge_agreement.py` measures how far it agrees with the labeled set.

Rule-based judge rules (on the "What happened next" section):
- a user message with a correction marker ("no", "wrong", "instead", "redo", "try again", "too
  long", "keep it short", ...) or a request about how to answer ("please call me ...", "start
  with ...", "I want ...", "next time ...": what a person says when an answer missed what they
  want, as a capable judge reads it)
  -> -1, hint = the user's message (with `hints="instruction"`: written as an instruction to the
  assistant, as the judge prompt asks a capable judge to write it; `instruction_hint`);
- else a user message with an acceptance marker ("thanks", "great", "works", "perfect", ...) -> +1;
- else, when tool results came back: any error marker ("error", "traceback", "not found",
  "permission denied", "exit code N>0", ...) -> -1, otherwise +1;
- else (silence, an unrelated new request) -> 0.
- When the prompt lists what the user asked for before (`clawbridge.rewards.judge.NOTES_SECTION`),
  a correction about the same kind of thing as listed note n (length, names, formatting, what
  comes first: `TOPICS`, by keywords, as a capable judge would group them) adds `SAME: n`.
- A correction asking for one of those kinds of thing adds, after its SCORE line, `REWRITE:` with
  the assistant's answer rewritten that way (then `END REWRITE`), by rules that read only the
  answer and the user's words (`rule_based_rewrite`: list markers and markdown removed; cut to
  whole sentences up to 25 words; the first sentence on a line of its own, the rest below it; the
  name the user gave put first), as a capable judge would write it. A tool call or an answer those rules leave unchanged gets none.
- A prompt that asks which candidate answers follow the user's notes
  (`clawbridge.rewards.note_check`) is answered by `rule_based_follows` (rules at its section).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

from clawbridge.chat.topic import on_topic
from clawbridge.rewards.judge import NOTES_SECTION
from clawbridge.rewards.note_check import ANSWERS_SECTION, REQUEST_SECTION

CORRECTION = re.compile(
    r"\b(no|nope|wrong|incorrect|not what|isn'?t what|not quite|instead|redo|try again|again|actually|"
    r"fix (it|this|that)|didn'?t|doesn'?t work|does not work|broke|broken|not right|should have|should be|"
    r"don'?t|stop|undo|revert|missed|forgot|still (fails|failing|broken|wrong)|"
    r"too (long|verbose|wordy|much)|(keep it|be|make it) (short|shorter|brief)|shorter|tl;?dr)\b",
    re.IGNORECASE,
)
REQUEST = re.compile(
    r"(\bplease (call|use|say|write|answer|start|put|give|keep|be|stop|avoid|address|don'?t|no)\b|"
    r"\bcall me\b|\baddress me\b|\bstart with\b|\bi (want|wanted|need|prefer|asked)\b|\bi'?d (like|prefer)\b|"
    r"\bnext time\b|\bonly\b.*\bplease\b)",
    re.IGNORECASE,
)
"""A request about how to answer: after an answer, a correction in polite words."""
ACCEPTANCE = re.compile(
    r"\b(thanks|thank you|thx|great|perfect|works|worked|working|good|nice|exactly|awesome|lgtm|"
    r"looks good|correct|yes|ok|okay|cool|excellent|love it|that'?s it|helpful|done|brilliant|fixed)\b",
    re.IGNORECASE,
)
TOOL_ERROR = re.compile(
    r"(error|exception|traceback|failed|failure|not found|no such file|permission denied|exit code [1-9]|"
    r"exit status [1-9]|command not found|timed out|timeout|enoent|refused|fatal|denied|\b(404|500)\b)",
    re.IGNORECASE,
)


TOPICS: dict[str, re.Pattern[str]] = {
    "length": re.compile(r"\b(long|longer|short|shorter|brief|wordy|words?|verbose|concise|too much|tl;?dr|"
                         r"sentence or two)\b", re.IGNORECASE),
    "name": re.compile(r"\b(my name|call me|address me|say my name|name|call the user|address the user)\b",
                       re.IGNORECASE),
    "format": re.compile(r"\b(lists?|bullets?( points?)?|bold|markdown|formatting|format|numbered|plain)\b",
                         re.IGNORECASE),
    "order": re.compile(r"\b(first|one[- ]line|one[- ]sentence|bury|up front|on top|then the details|details after)\b",
                        re.IGNORECASE),
}
"""What kind of thing a correction asks for, by keywords (the rule-based judge's `SAME:`)."""


def topics(text: str) -> set[str]:
    """The kinds of thing `text` asks for: those with the most keyword hits (none: empty)."""
    hits = {k: len(p.findall(text)) for k, p in TOPICS.items()}
    best = max(hits.values())
    return {k for k, v in hits.items() if v == best} if best else set()


def same_as(hint: str, notes: list[str]) -> int | None:
    """The first listed note (1-based) that asks for the same kind of thing as `hint`, or None."""
    mine = topics(hint)
    return next((i for i, n in enumerate(notes, 1) if mine & topics(n)), None)


def _notes(prompt: str) -> list[str]:
    listed = _section(prompt, NOTES_SECTION)
    return [m.group(1) for m in re.finditer(r"^\[\d+\] (.*)$", listed, re.MULTILINE)]


def _section(prompt: str, title: str) -> str:
    m = re.search(rf"## {re.escape(title)}[^\n]*\n(.*?)(?=\n## |\Z)", prompt, re.DOTALL)
    return m.group(1).strip() if m else ""


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_LIST_MARK = re.compile(r"^\s*(?:[-*\u2022]|\d+[.)])\s+", re.MULTILINE)
_GIVEN_NAME = re.compile(r"\b(?:call me|address me as|my name,?|name is)\s+([A-Z][a-z]+)\b")
BRIEF_WORDS = 25
"""A rule-based rewrite for "too long" keeps whole sentences up to this many words."""
LEAD_WORDS = 20
"""A rule-based lead line has at most this many words."""
LEAD_MIN_WORDS = 3
"""...and at least this many: "Sure!" or "The answer is:" is no answer put first."""


def _sentences(text: str) -> list[str]:
    flat = " ".join(ln.strip() for ln in text.splitlines() if ln.strip())
    return [x for x in _SENTENCE_END.split(flat) if x]


def _cut_words(sentence: str, n: int) -> str:
    ws = sentence.split()
    return sentence if len(ws) <= n else " ".join(ws[:n]).rstrip(",;:") + "."


def _brief(text: str) -> str:
    out: list[str] = []
    for x in _sentences(text):
        if out and len(" ".join([*out, x]).split()) > BRIEF_WORDS:
            break
        out.append(x)
    return _cut_words(" ".join(out), BRIEF_WORDS) if out else text


def _lead(text: str) -> str:
    parts = _sentences(text)
    while len(parts) > 2 and (len(parts[0].split()) < LEAD_MIN_WORDS or parts[0].endswith("?")):  # "Sure!", "1."
        parts = parts[1:]
    if len(parts) < 2:
        return text
    return f"{_cut_words(parts[0], LEAD_WORDS)}\n\n{' '.join(parts[1:])}"


def _plain_text(text: str) -> str:
    return " ".join(_sentences(re.sub(r"[*_#`]+", "", _LIST_MARK.sub("", text))))


def rule_based_rewrite(answer: str, hint: str) -> str | None:
    """The answer rewritten the way the correction `hint` asks (module rules), or None."""
    text = answer.strip()
    if not text or text == "(no text)" or "TOOL CALL " in text:
        return None
    kinds = topics(hint)
    out = text
    if "format" in kinds:
        out = _plain_text(out)
    if "length" in kinds:
        out = _brief(out)
    if "order" in kinds:
        out = _lead(out)
    name = _GIVEN_NAME.search(hint)
    if "name" in kinds and name and name.group(1).lower() not in out.lower():
        out = f"{name.group(1)}, {out[:1].lower() if out[:2] != 'I ' else out[:1]}{out[1:]}"
    return out if out != text else None


COMPLAINT_ONLY = re.compile(
    r"^(too|way too|that'?s|this is|it'?s|you (didn'?t|did not|forgot)|not what|wrong|nope)\b", re.IGNORECASE)
"""A sentence that only says what was wrong ("Too long.", "You didn't use my name."): an
instruction hint leaves it out when the user also said what they want."""
_OPENERS = re.compile(r"^(?:(?:no|nope|ok|okay|so|and),\s+|please\s+)+", re.IGNORECASE)
_POLITE = re.compile(r",?\s*\b(?:please|next time)\b", re.IGNORECASE)
_PERSON: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(a, re.IGNORECASE), b) for a, b in (
    (r"\bI want\b", "the user wants"), (r"\bI'?d like\b", "the user would like"), (r"\bI need\b", "the user needs"),
    (r"\bI prefer\b", "the user prefers"), (r"\bI asked\b", "the user asked"), (r"\bI'?m\b", "the user is"),
    (r"\bby my name\b", "by name"), (r"\bmy\b", "the user's"), (r"\bme\b", "the user"), (r"\bI\b", "the user"),
))
"""The user's first person, as the assistant's instruction names them ("call me Sam" -> "call the user Sam")."""


def instruction_hint(words: str) -> str:
    """The user's correction written as a short instruction to the assistant (module rules), as
    `clawbridge.rewards.judge.SYSTEM_PROMPT` asks a judge to write its hint: the sentences that
    only complain are left out when others remain, openers ("No, ", "please") and "next time" go,
    and the user is named in the third person. Reads only the user's words."""
    parts = [x.strip() for x in _SENTENCE_END.split(" ".join(words.split())) if x.strip()]
    asked = [x for x in parts if not COMPLAINT_ONLY.match(x)] or parts
    out = []
    for x in asked:
        x = _POLITE.sub("", _OPENERS.sub("", x)).strip()
        for pattern, said in _PERSON:
            x = pattern.sub(said, x)
        x = re.sub(r"\s+([,.!?;])", r"\1", x).strip(" ,")
        if x:
            out.append(x[:1].upper() + x[1:] + ("" if x[-1] in ".!?" else "."))
    return " ".join(out) or words.strip()


def _answer_of(prompt: str) -> str:
    m = re.search(r"## Assistant turn\n(.*?)\n\n## What happened next", prompt, re.DOTALL)
    return m.group(1) if m else ""


def rule_based_verdict(prompt: str) -> tuple[int, str | None, str]:
    """(score, hint, reason) for a judge prompt, by the module's keyword rules."""
    nxt = _section(prompt, "What happened next")
    users = [line[len("[user] "):] for line in nxt.splitlines() if line.startswith("[user] ")]
    tools = [line for line in nxt.splitlines() if line.startswith("[tool result")]
    user_text = " ".join(users).strip()
    if user_text and (CORRECTION.search(user_text) or REQUEST.search(user_text)):
        return -1, user_text[:300], "the user corrected the turn"
    if user_text and ACCEPTANCE.search(user_text):
        return 1, None, "the user accepted the turn"
    if tools:
        bad = [t for t in tools if TOOL_ERROR.search(t)]
        if bad:
            return -1, None, "a tool call failed"
        return 1, None, "the tool calls succeeded"
    return 0, None, "no clear signal"


HintStyle = Literal["words", "instruction"]
"""How the rule-based judge writes its hint: `words`, the user's correction as they said it;
`instruction`, that correction as an instruction to the assistant (`instruction_hint`)."""


def rule_based_answer(body: dict[str, Any], hints: HintStyle = "words") -> str:
    """The rule-based judge's answer text for an OpenAI chat request body, its hint as `hints` says."""
    messages = body.get("messages") or []
    prompt = "\n".join(str(m.get("content") or "") for m in messages if m.get("role") == "user")
    if is_check_prompt(prompt):
        return rule_based_follows(prompt)
    score, words, reason = rule_based_verdict(prompt)
    shown = "0" if score == 0 else f"{score:+d}"
    same = same_as(words, _notes(prompt)) if words else None
    said = f"\nSAME: {same}" if same is not None else ""
    rewrite = rule_based_rewrite(_answer_of(prompt), words) if words and score < 0 else None
    written = f"\nREWRITE:\n{rewrite}\nEND REWRITE" if rewrite else ""
    hint = instruction_hint(words) if words and hints == "instruction" else words
    return f"{reason} (rule-based judge).\nHINT: {hint or 'none'}{said}\nSCORE: {shown}{written}"


def rule_based(hints: HintStyle = "words") -> Callable[[dict[str, Any]], str]:
    """`rule_based_answer` writing its hints as `hints` says (a `JudgeServer` answer)."""
    return functools.partial(rule_based_answer, hints=hints)


# ------------------------------------------------------------------ the check of candidate answers
# Answers the prompt `clawbridge.rewards.note_check.check_messages` builds: which numbered answers
# follow every listed note, reading the notes and the answers only (never a persona's rule). For
# each note, by its kind (`TOPICS`): length (unless it also asks what comes first: then the lead
# line's), at most the number of words it names ("under 30 words": fewer than 30), else at most
# `BRIEF_WORDS`; format, no list lines, bold or headings; order, a first line of `LEAD_MIN_WORDS` to
# `LEAD_WORDS` words that ends a statement (not a colon: "The answer is:" introduces, it does not
# answer; not a question mark: the question repeated is no answer) and is no list item, then more
# lines; name, the answer says a name the note gives (a capitalized word not starting a sentence).
# A note of no known kind, or a name not found, is not checked. `FOLLOWS: none` when no answer
# passes them all. Of those that pass, only the ones that talk about the request are named when
# any does (`clawbridge.chat.topic.on_topic`, a lexical floor: the check prompt asks for answers
# that still answer it, and "Tip: High Fries" to a question about groceries does not); when none
# does, all that pass are named (a lexical check misses answers in other words, so it never
# rejects them all).
_MARKDOWN = re.compile(r"\*\*|__|^#{1,6}\s", re.MULTILINE)
_LIMIT = re.compile(r"\b(under|fewer than|less than|at most|no more than|within|max(?:imum)?)?\s*(\d+)\s+words?\b",
                    re.IGNORECASE)
_STRICT = ("under", "fewer than", "less than")


def _names(note: str) -> set[str]:
    """Capitalized words of `note` that do not start a sentence (the name it asks for)."""
    text = note.strip()
    return {m.group(0) for m in re.finditer(r"\b[A-Z][a-z]+\b", text)
            if text[:m.start()].rstrip() and text[:m.start()].rstrip()[-1] not in ".!?"}


def follows_note(answer: str, note: str) -> bool:
    """Whether `answer` follows `note` by the module's rules (a note it cannot check: True)."""
    text = answer.strip()
    kinds = topics(note)
    ok = True
    if "length" in kinds and "order" not in kinds:  # "the short answer in one line": the lead line's length
        m = _LIMIT.search(note)
        if m:
            n = int(m.group(2))
            strict = (m.group(1) or "").lower() in _STRICT
            ok = ok and (len(text.split()) < n if strict else len(text.split()) <= n)
        else:
            ok = ok and len(text.split()) <= BRIEF_WORDS
    if "format" in kinds:
        ok = ok and not _LIST_MARK.search(text) and not _MARKDOWN.search(text)
    if "order" in kinds:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        ok = (ok and len(lines) >= 2 and LEAD_MIN_WORDS <= len(lines[0].split()) <= LEAD_WORDS
              and lines[0][-1] in ".!" and not _LIST_MARK.match(lines[0]))
    names = _names(note) if "name" in kinds else set()
    if names:
        ok = ok and any(re.search(rf"\b{re.escape(n)}\b", text, re.IGNORECASE) for n in names)
    return ok


def is_check_prompt(prompt: str) -> bool:
    """Whether `prompt` asks which candidate answers follow the notes."""
    return f"## {ANSWERS_SECTION}" in prompt and f"## {REQUEST_SECTION}" in prompt


def rule_based_follows(prompt: str) -> str:
    """The rule-based judge's answer to a check prompt: a reason, then `FOLLOWS:`."""
    notes = [m.group(1) for m in re.finditer(r"^\[\d+\] (.*)$", _section(prompt, NOTES_SECTION), re.MULTILINE)]
    shown = prompt.split(f"## {ANSWERS_SECTION}\n", 1)[-1]  # the last section: answers may hold headings
    answers = [a.strip() for a in re.split(r"^### Answer \d+\n", shown, flags=re.MULTILINE)[1:]]
    good = [i for i, a in enumerate(answers, 1) if all(follows_note(a, n) for n in notes)]
    request = _section(prompt, REQUEST_SECTION)
    answering = [i for i in good if on_topic(request, answers[i - 1])]
    said = ", ".join(map(str, answering or good)) if good else "none"
    why = f", {len(answering)} of them about the request" if answering and len(answering) < len(good) else ""
    return f"{len(good)} of {len(answers)} answers follow the notes{why} (rule-based judge).\nFOLLOWS: {said}"


class JudgeServer:
    """`answer(body) -> text` behind an OpenAI-compatible endpoint; use as a context manager."""

    def __init__(self, answer: Callable[[dict[str, Any]], str] = rule_based_answer, model: str = "rule-based",
                 port: int = 0, api_key: str | None = None) -> None:
        self.answer = answer
        self.model = model
        self.api_key = api_key
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the caller timed out and went away (a loaded machine): it retries; no traceback

            def do_GET(self) -> None:
                self._send(200, {"object": "list", "data": [{"id": server.model, "object": "model"}]})

            def do_POST(self) -> None:
                if server.api_key and self.headers.get("Authorization") != f"Bearer {server.api_key}":
                    self._send(401, {"error": {"message": "bad key"}})
                    return
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                with server._lock:
                    server.requests.append(body)
                try:
                    text = server.answer(body)
                except Exception as exc:  # a scripted failure: answer 500
                    self._send(500, {"error": {"message": str(exc)}})
                    return
                self._send(200, {
                    "id": f"chatcmpl-judge-{time.time_ns()}", "object": "chat.completion", "created": int(time.time()),
                    "model": server.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                })

        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="judge-server", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> JudgeServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> JudgeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    """`python -m clawbridge.devtools.judge_server [PORT] [--hints instruction]`: serve the rule-based
    judge until ^C."""
    ap = argparse.ArgumentParser(description="Serve the rule-based judge (keyword rules, not a language model) "
                                 "on 127.0.0.1.")
    ap.add_argument("port", nargs="?", type=int, default=0, help="the port (default: a free one)")
    ap.add_argument("--hints", choices=("words", "instruction"), default="words",
                    help="the hint: the user's correction as said (words) or as an instruction to the assistant")
    args = ap.parse_args()
    srv = JudgeServer(rule_based(args.hints), port=args.port).start()
    print(f"rule-based judge (not a language model, {args.hints} hints) at {srv.base_url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        srv.stop()


if __name__ == "__main__":
    main()
