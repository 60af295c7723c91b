"""End to end with real OpenClaw: clawbridge records OpenClaw's turns, grouped by session.

Needs Node 24 and openclaw@2026.9.6 (`.ci/install_openclaw.sh`); skipped with the reason otherwise.
Starts `clawbridge up` with the tiny model, installs the extension with the installer into a
temporary OpenClaw home, runs two user turns in one session (`agent --local --session-id`) and a
heartbeat through a gateway (`system event --mode now`), then asserts on
`clawbridge sessions show <session> --json`:
- the user session (`agent:main:explicit:<id>`, the key OpenClaw sends as X-Session-Id) has
  exactly two main turns, whose recorded completion ids decode to what OpenClaw printed;
- the heartbeat is recorded as a side turn in the main session (`agent:main:main`).
Each OpenClaw step runs under a timeout; on this 2-core machine a turn takes 25-60 s and the
gateway 60-70 s to start, so the whole test takes a few minutes.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from clawbridge.chat.parse import parse_completion
from clawbridge.openclaw import installer, json5edit
from clawbridge.openclaw.toolchain import find_node, find_openclaw, missing_reason
from tests.openclaw_support import (
    TURN_TIMEOUT_S,
    clawbridge_cmd,
    openclaw_env,
    printed_text,
    run_openclaw,
    show_session,
)
from tests.support import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SESSION = "e2e-s1"
SESSION_KEY = f"agent:main:explicit:{SESSION}"
HEARTBEAT_SESSION_KEY = "agent:main:main"
GATEWAY_READY_TIMEOUT_S = 240
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def toolchain() -> None:
    reason = missing_reason(need_openclaw=True)
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def clawbridge_server(toolchain: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("e2e")
    model_dir, state = root / "tiny", root / "state"
    subprocess.run([*clawbridge_cmd(), "model", "tiny", str(model_dir)], check=True, timeout=300)
    port = free_port()
    log = (root / "clawbridge.log").open("w")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWBRIDGE_")}
    proc = subprocess.Popen(
        [*clawbridge_cmd(), "up", "--backend", "local", "--model", str(model_dir), "--port", str(port),
         "--state-dir", str(state)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"clawbridge up exited {proc.returncode}:\n{(root / 'clawbridge.log').read_text()[-4000:]}"
                )
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("clawbridge did not become healthy in 180 s")
            time.sleep(1)
        yield {
            "root": root,
            "state": state,
            "model_dir": model_dir,
            "base_url": base_url,
            "log": root / "clawbridge.log",
        }
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def openclaw_home(clawbridge_server: dict[str, Any]) -> Path:
    """A fresh OpenClaw home with clawbridge installed by the installer (as the default model)."""
    from clawbridge.cli.openclaw_cmd import served_model

    home = clawbridge_server["root"] / "home"
    config = home / ".openclaw" / "openclaw.json"
    config.parent.mkdir(parents=True)
    config.write_text("// e2e OpenClaw home\n{\n  update: { checkOnStart: false }, // no network here\n}\n")
    state = clawbridge_server["state"]
    key = installer.resolve_client_key(state, {})
    info = served_model(clawbridge_server["base_url"], key) or {}
    assert info.get("id"), "clawbridge /v1/models listed no model"
    installer.install(
        state,
        installer.InstallOptions(
            api_key=key,
            config_path=config,
            base_url=clawbridge_server["base_url"],
            model_id=str(info["id"]),
            context_window=int(info.get("context_window") or installer.DEFAULT_CONTEXT_WINDOW),
            max_tokens=min(MAX_TOKENS, int(info.get("max_output_tokens") or MAX_TOKENS)),
            set_default=True,
        ),
    )
    text = config.read_text()
    assert "// no network here" in text
    assert json5edit.get(text, ["agents", "defaults", "model", "primary"]) == f"clawbridge/{info['id']}"
    return home


def _decode(model_dir: Path, ids: list[int]) -> str:
    """The text of the sampled ids, special tokens kept (the proxy's own decode): the random tiny
    model can sample `<|im_start|>` mid-answer, and the proxy sends it as text, as the ids say."""
    from clawbridge.chat.render import Renderer

    return Renderer.from_pretrained(str(model_dir)).decode(ids)


def _same_answer(printed: str, decoded: str) -> float:
    """How alike OpenClaw's printed answer and the recorded ids' text are (difflib ratio, 0..1).

    Not equality: OpenClaw cleans up what it displays (seen here: a random word-piece run shown
    as "..."), so the printed text may differ from what it received in a few characters.
    """
    import difflib

    return difflib.SequenceMatcher(None, printed.strip(), decoded.strip(), autojunk=False).ratio()


def test_two_user_turns_are_one_session_of_main_turns(
    clawbridge_server: dict[str, Any], openclaw_home: Path
) -> None:
    started = time.monotonic()
    printed = []
    for message in ("Hello there, first message.", "And a second message."):
        out = run_openclaw(
            openclaw_home, "agent", "--local", "--session-id", SESSION, "--message", message, "--json"
        )
        printed.append(printed_text(out))
    turn_seconds = (time.monotonic() - started) / 2
    print(f"openclaw local turn: {turn_seconds:.1f} s each")

    doc = show_session(clawbridge_server["state"], SESSION_KEY)
    assert doc is not None, f"no session {SESSION_KEY}; log:\n{clawbridge_server['log'].read_text()[-3000:]}"
    assert doc["session_id"] == SESSION_KEY
    main = [t for t in doc["turns"] if t["turn_type"] == "main"]
    assert len(main) == 2, [(t["turn_type"], t.get("meta")) for t in doc["turns"]]
    assert all(t["turn_type"] == "side" for t in doc["turns"] if t not in main)
    for turn, text in zip(main, printed, strict=True):
        assert turn["completion_token_ids"], "no completion recorded"
        assert len(turn["completion_logprobs"]) == len(turn["completion_token_ids"])
        assert turn["prompt_token_ids"]
        assert (turn.get("meta") or {}).get("trigger", "user") == "user"
        parsed = parse_completion(_decode(clawbridge_server["model_dir"], turn["completion_token_ids"]))
        sent = turn["response"]["choices"][0]["message"]
        # Token exact: the recorded ids, decoded and parsed, are what was sent to OpenClaw...
        assert (parsed.content, parsed.reasoning_content) == (sent.get("content"), sent.get("reasoning_content"))
        # ...and that is what OpenClaw showed, up to its own display clean-up.
        assert text.strip() and _same_answer(text, parsed.content or "") > 0.9, (text, parsed.content)
    # The second turn's prompt carries the first turn's conversation.
    first_user = main[0]["request"]["messages"]
    second_user = main[1]["request"]["messages"]
    assert len(second_user) > len(first_user)


def test_heartbeat_through_gateway_is_a_side_turn(
    clawbridge_server: dict[str, Any], openclaw_home: Path
) -> None:
    node, entry = find_node(), find_openclaw()
    assert node is not None and entry is not None
    port = free_port()
    log_path = clawbridge_server["root"] / "gateway.log"
    with log_path.open("w") as log:
        gateway = subprocess.Popen(
            [str(node), str(entry), "gateway", "run", "--port", str(port), "--bind", "loopback", "--auth", "token",
             "--token", "e2e-token", "--allow-unconfigured"],
            env=openclaw_env(openclaw_home, port), stdout=log, stderr=subprocess.STDOUT, cwd=openclaw_home,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + GATEWAY_READY_TIMEOUT_S
            while "[gateway] ready" not in log_path.read_text().replace("\x1b[36m", "").replace(
                "\x1b[39m", ""
            ):
                assert gateway.poll() is None, f"gateway exited:\n{log_path.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"gateway not ready:\n{log_path.read_text()[-3000:]}"
                time.sleep(2)
            run_openclaw(openclaw_home, "system", "event", "--text", "Check for urgent follow-ups", "--mode", "now",
                      gateway_port=port, timeout=120)  # fmt: skip
            deadline = time.monotonic() + TURN_TIMEOUT_S
            side: list[dict[str, Any]] = []
            while not side:
                doc = show_session(clawbridge_server["state"], HEARTBEAT_SESSION_KEY)
                side = [
                    t
                    for t in (doc or {}).get("turns", [])
                    if (t.get("meta") or {}).get("trigger") == "heartbeat"
                ]
                if not side:
                    assert time.monotonic() < deadline, (
                        f"no heartbeat turn; gateway log:\n{log_path.read_text()[-3000:]}"
                    )
                    time.sleep(3)
            assert all(t["turn_type"] == "side" for t in side)
            assert side[0]["completion_token_ids"]
        finally:
            gateway.terminate()
            try:
                gateway.wait(timeout=30)
            except subprocess.TimeoutExpired:
                gateway.kill()


def test_openai_responses_provider_is_recorded_as_responses_turns(
    clawbridge_server: dict[str, Any], openclaw_home: Path
) -> None:
    """OpenClaw's `openai-responses` provider (streamed Responses API events) against /v1/responses."""
    home = clawbridge_server["root"] / "home-responses"
    config = home / ".openclaw" / "openclaw.json"
    config.parent.mkdir(parents=True)
    text = (openclaw_home / ".openclaw" / "openclaw.json").read_text()
    text = json5edit.replace_source(text, ["models", "providers", "clawbridge", "api"], '"openai-responses"')
    config.write_text(text)
    session = "e2e-responses"
    out = run_openclaw(home, "agent", "--local", "--session-id", session, "--message", "Hello, responses.", "--json")
    printed = printed_text(out)

    doc = show_session(clawbridge_server["state"], f"agent:main:explicit:{session}")
    assert doc is not None, f"no session; log:\n{clawbridge_server['log'].read_text()[-3000:]}"
    main = [t for t in doc["turns"] if t["turn_type"] == "main"]
    assert len(main) == 1 and main[0]["meta"]["api"] == "responses", [t.get("meta") for t in doc["turns"]]
    turn = main[0]
    assert turn["status"] == "ok" and turn["meta"]["stream"] is True and "input" in turn["request"]
    parsed = parse_completion(_decode(clawbridge_server["model_dir"], turn["completion_token_ids"]))
    sent = "".join(part["text"] for item in turn["response"]["output"] if item["type"] == "message"
                   for part in item["content"])
    # Token exact: the recorded ids, decoded and parsed, are the text sent; OpenClaw showed it.
    assert (parsed.content or "") == sent
    assert printed.strip() and _same_answer(printed, sent) > 0.9, (printed, sent)
