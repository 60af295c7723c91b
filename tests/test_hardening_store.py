"""Issue 11, faults: private state dir, a damaged or unusable store refused before serving, a full
disk answered clearly (never 200 for a turn that was not recorded), and draining on shutdown.

Real SQLite throughout: "disk full" is SQLite's own SQLITE_FULL (from `PRAGMA max_page_count`),
corruption is bytes overwritten in the middle of a real store file.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from clawbridge.chat.render import Renderer
from clawbridge.store import DB_FILENAME, Store, TurnRecord
from clawbridge.store.health import StateDirError, StoreCorrupt, check_store_file, prepare_state_dir
from tests.fake_proxy import SwitchableSampler, script_for, start_fake_proxy
from tests.support import InProcessProxy, free_port

MSG = [{"role": "user", "content": "hi"}]


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "clawbridge.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def fill_store(state_dir: Path, n: int = 300) -> None:
    store = Store.open(state_dir)
    for i in range(n):
        now = time.time()
        store.record_turn(TurnRecord(
            session_id=f"s{i % 30}", turn_type="main", status="ok", model="tiny", prompt_token_ids=list(range(200)),
            completion_token_ids=[1, 2, 3], completion_logprobs=[-0.1, -0.2, -0.3], policy_version=0,
            finish_reason="stop", request_json='{"messages": []}', response_json=None, created_at=now,
            completed_at=now))
    store.close()


# ------------------------------------------------------------------ permissions


def test_new_state_dir_and_store_are_private(tiny_model_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "fresh"
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    proxy = start_fake_proxy(tiny_model_dir, state, SwitchableSampler(script=script_for(renderer, "ok")))
    try:
        client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=str(proxy.state.keys.client), max_retries=0)
        client.chat.completions.create(model="tiny", messages=MSG)  # type: ignore[arg-type]
        assert mode(state) == 0o700
        for suffix in ("", "-wal", "-shm"):
            assert mode(state / f"{DB_FILENAME}{suffix}") == 0o600, suffix
    finally:
        proxy.stop()


def test_existing_loose_state_dir_is_tightened_and_said(tmp_path: Path) -> None:
    state = tmp_path / "loose"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    sqlite3.connect(str(state / DB_FILENAME)).execute("CREATE TABLE t(x)").connection.close()
    (state / DB_FILENAME).chmod(0o644)
    notes = prepare_state_dir(state)
    assert mode(state) == 0o700 and mode(state / DB_FILENAME) == 0o600
    assert any("tightened" in n and "0o755" in n for n in notes), notes
    assert prepare_state_dir(state) == []  # nothing to say the second time


def test_unusable_state_dir_is_refused_before_serving(tiny_model_dir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a dir")
    with pytest.raises(StateDirError, match="cannot create the state dir"):
        prepare_state_dir(blocker / "state")
    out = cli("up", "--model", str(tiny_model_dir), "--port", str(free_port()), "--state-dir", str(blocker / "state"))
    assert out.returncode == 1, out
    assert "cannot create the state dir" in out.stderr and "serving" not in out.stdout
    assert "Traceback" not in out.stderr + out.stdout


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only (0500) directory anyway")
def test_read_only_state_dir_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "ro"
    state.mkdir()
    state.chmod(0o500)
    try:
        with pytest.raises(StateDirError, match="not writable"):
            prepare_state_dir(state)
    finally:
        state.chmod(0o700)


# ------------------------------------------------------------------ integrity


def corrupt_middle(db: Path) -> None:
    size = db.stat().st_size
    with db.open("r+b") as f:
        f.seek((size // 2) // 4096 * 4096)
        f.write(b"\xde\xad\xbe\xef" * 2048)


def test_corrupt_store_is_refused_then_recovered(tiny_model_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    fill_store(state)
    db = state / DB_FILENAME
    corrupt_middle(db)
    with pytest.raises(StoreCorrupt, match="clawbridge store recover"):
        check_store_file(db)
    out = cli("up", "--model", str(tiny_model_dir), "--port", str(free_port()), "--state-dir", str(state))
    assert out.returncode == 1, out
    assert str(db) in out.stderr and "store recover" in out.stderr and "serving" not in out.stdout
    assert "Traceback" not in out.stderr + out.stdout
    checked = cli("store", "check", "--state-dir", str(state))
    assert checked.returncode == 1 and "damaged" in checked.stderr
    recovered = cli("store", "recover", "--state-dir", str(state))
    assert recovered.returncode == 0, recovered
    assert "turns:" in recovered.stdout and list(state.glob(f"{DB_FILENAME}.damaged-*"))
    assert cli("store", "check", "--state-dir", str(state)).returncode == 0
    check_store_file(db)
    store = Store(db)
    try:
        stats = store.stats()
        # Most rows survive a one-page hole; the schema is intact and the store is writable again.
        assert 0 < stats["turns"]["main"] <= 300 and store.schema_version > 0
    finally:
        store.close()
    assert mode(db) == 0o600


def test_zero_byte_store_is_not_a_fresh_store(tiny_model_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / DB_FILENAME).touch()
    out = cli("up", "--model", str(tiny_model_dir), "--port", str(free_port()), "--state-dir", str(state))
    assert out.returncode == 1 and "0 bytes" in out.stderr and "serving" not in out.stdout, out
    assert (state / DB_FILENAME).stat().st_size == 0  # untouched


def test_backup_is_a_consistent_private_copy(tmp_path: Path) -> None:
    state = tmp_path / "state"
    fill_store(state, 20)
    out = cli("store", "backup", "--state-dir", str(state))
    assert out.returncode == 0, out
    (backup,) = (state / "backups").glob("*.db")
    assert mode(backup) == 0o600
    copy = Store(backup)
    try:
        assert copy.stats()["turns"]["main"] == 20
    finally:
        copy.close()


# ------------------------------------------------------------------ disk full


@pytest.fixture()
def fake(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[InProcessProxy, SwitchableSampler]]:
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    sampler = SwitchableSampler(script=script_for(renderer, "hello there"))
    proxy = start_fake_proxy(tiny_model_dir, tmp_path / "state", sampler)
    yield proxy, sampler
    proxy.stop()


def chat(proxy: InProcessProxy, **extra: Any) -> httpx.Response:
    return httpx.post(proxy.base + "/v1/chat/completions", json={"model": "tiny", "messages": MSG, **extra},
                      headers={"Authorization": f"Bearer {proxy.state.keys.client}"}, timeout=60)


def test_low_disk_is_507_before_sampling_and_health_says_so(fake: tuple[InProcessProxy, SwitchableSampler]) -> None:
    proxy, sampler = fake
    proxy.state.settings.min_free_disk_bytes = 2**62
    try:
        for stream in (False, True):
            r = chat(proxy, stream=stream)
            assert r.status_code == 507, r.text
            assert r.json()["error"]["code"] == "insufficient_storage" and "free" in r.json()["error"]["message"]
        assert sampler.calls == []  # refused before any model time was spent
        health = httpx.get(proxy.base + "/health")
        assert health.status_code == 503 and health.json()["status"] == "failing"
    finally:
        proxy.state.settings.min_free_disk_bytes = 0
    assert httpx.get(proxy.base + "/health").status_code == 200
    assert chat(proxy).status_code == 200


def test_store_full_is_never_a_200(fake: tuple[InProcessProxy, SwitchableSampler]) -> None:
    proxy, _ = fake
    store = proxy.state.store
    big = [{"role": "user", "content": "word " * 1500}]  # a turn that needs new pages
    with store.read() as c:  # fault injection: SQLite's own SQLITE_FULL once the file cannot grow
        pages = c.execute("PRAGMA page_count").fetchone()[0]
        c.execute(f"PRAGMA max_page_count={pages}")
    try:
        r = chat(proxy, messages=big)
        assert r.status_code == 507, r.text
        assert r.json()["error"]["code"] == "store_full" and "free disk space" in r.json()["error"]["message"]
        with httpx.stream("POST", proxy.base + "/v1/chat/completions",
                          json={"model": "tiny", "messages": big, "stream": True},
                          headers={"Authorization": f"Bearer {proxy.state.keys.client}"}, timeout=60) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert "store_full" in events[-1] and "[DONE]" not in "".join(events)
        assert not any('"finish_reason":"stop"' in e for e in events)
        health = httpx.get(proxy.base + "/health")
        assert health.status_code == 503 and "recording turns fails" in health.json()["store"]
    finally:
        with store.read() as c:
            c.execute("PRAGMA max_page_count=1073741823")
    assert chat(proxy).status_code == 200
    assert httpx.get(proxy.base + "/health").json()["status"] == "ok"


# ------------------------------------------------------------------ draining


def test_shutdown_drains_then_ends_running_calls_with_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    slow = SwitchableSampler(script=script_for(renderer, "word " * 400), delay_s=0.05)  # ~20 s per call
    proxy = start_fake_proxy(tiny_model_dir, tmp_path / "state", slow, drain_grace_s=1.0)
    headers = {"Authorization": f"Bearer {proxy.state.keys.client}"}
    results: dict[str, Any] = {}

    def whole() -> None:
        results["whole"] = chat(proxy)

    def streamed() -> None:
        with httpx.stream("POST", proxy.base + "/v1/chat/completions", headers=headers, timeout=60,
                          json={"model": "tiny", "messages": MSG, "stream": True}) as s:
            results["stream"] = [line for line in s.iter_lines() if line.startswith("data: ")]

    threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(slow.calls) < 2:
        assert time.monotonic() < deadline, "calls never reached the sampler"
        time.sleep(0.05)
    proxy.stop()
    for t in threads:
        t.join(30)
    r = results["whole"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text
    assert "server_shutting_down" in results["stream"][-1]
    store = Store.open(tmp_path / "state")
    try:
        statuses = [t["status"] for s in store.list_sessions() for t in store.session_turns(s.session_id)]
    finally:
        store.close()
    assert statuses == ["cancelled", "cancelled"]


def test_status_warns_past_the_store_budget(tmp_path: Path) -> None:
    from rich.console import Console

    from clawbridge.cli.status import gather_status, print_status
    from clawbridge.cli.target import target_of
    from clawbridge.config import Settings

    state = tmp_path / "state"
    fill_store(state, 20)
    settings = Settings(state_dir=state, port=free_port(), store_budget_bytes=4096)
    info = gather_status(target_of(settings))
    assert info["store"]["size_bytes"] > 4096
    assert any("store_budget_bytes" in w for w in info["warnings"])
    console = Console(record=True, width=200)
    print_status(console, info)
    assert "warning: the store is" in console.export_text()
    roomy = gather_status(target_of(Settings(state_dir=state, port=settings.port)))
    assert "warnings" not in roomy
