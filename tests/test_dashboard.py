"""The dashboard's HTTP side and `/metrics` on a real proxy that has trained one step: who may
see data (login cookie, admin key, one-time link), CSRF on writes, what the JSON documents hold,
bad input, and the Prometheus exposition parsed by prometheus_client's own text parser."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from clawbridge_fireworks.settings import FireworksSettings
from prometheus_client.parser import text_string_to_metric_families

from clawbridge.dashboard.auth import COOKIE
from tests.dashboard_support import ANSWER, TrainedProxy, start_trained_proxy

METRICS_KEY = "metrics-key-for-tests-0123456789"


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainedProxy]:
    t = start_trained_proxy(tiny_model_dir, tmp_path_factory.mktemp("dash-state"), metrics_key=METRICS_KEY)
    try:
        yield t
    finally:
        t.proxy.stop()


def login(t: TrainedProxy) -> tuple[httpx.Client, str]:
    """A logged-in client and the page's CSRF token."""
    c = httpx.Client(base_url=t.base, follow_redirects=False)
    r = c.post("/dashboard/login", data={"key": t.admin})
    assert r.status_code == 303 and r.headers["location"] == "/dashboard"
    page = c.get("/dashboard")
    m = re.search(r'<meta name="csrf-token" content="([^"]+)">', page.text)
    assert page.status_code == 200 and m is not None
    return c, m.group(1)


def test_without_a_login_nothing_is_shown(trained: TrainedProxy) -> None:
    with httpx.Client(base_url=trained.base) as c:
        page = c.get("/dashboard")
        assert page.status_code == 200 and 'name="key"' in page.text
        assert "dash-0" not in page.text and "csrf-token" not in page.text
        assert c.get("/dashboard/sessions/dash-0").text.count("dash-0") == 0
        for path in ("/dashboard/api/overview", "/dashboard/api/sessions", "/dashboard/api/sessions/dash-0"):
            r = c.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "dashboard_login_required", path
        # wrong keys: the client key, a wrong admin key, an empty form, a forged cookie
        for form in ({"key": trained.client_key}, {"key": trained.admin + "x"}, {}):
            r = c.post("/dashboard/login", data=form)
            assert r.status_code == 401 and COOKIE not in r.headers.get("set-cookie", "")
            assert "not the admin key" in r.text
        with httpx.Client(base_url=trained.base, cookies={COOKIE: "forged"}) as forged:
            assert forged.get("/dashboard/api/overview").status_code == 401
        r = c.get("/dashboard/api/overview", headers={"Authorization": f"Bearer {trained.client_key}"})
        assert r.status_code == 401
        r = c.post("/dashboard/api/sessions/dash-0/reward", json={"reward": 1.0})
        assert r.status_code == 401
        r = c.post("/dashboard/login", json={"key": trained.admin})
        assert r.status_code == 415 and COOKIE not in r.headers.get("set-cookie", "")
        r = c.post("/dashboard/login", data={"key": "x" * 5000})
        assert r.status_code == 413


def test_login_cookie_is_httponly_strict_and_gives_the_data(trained: TrainedProxy) -> None:
    c = httpx.Client(base_url=trained.base, follow_redirects=False)
    r = c.post("/dashboard/login", data={"key": trained.admin})
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=") and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert trained.admin not in cookie and trained.admin not in r.headers.get("location", "")
    page = c.get("/dashboard")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["cache-control"] == "no-store"
    # the page needs nothing from elsewhere: every script and stylesheet is ours
    assert re.findall(r'(?:src|href)="(https?:)?//', page.text) == []
    for name in ("dashboard.js", "chart.js", "dashboard.css"):
        assert c.get(f"/dashboard/static/{name}").status_code == 200
    assert c.get("/dashboard/static/../auth.py").status_code == 404

    doc = c.get("/dashboard/api/overview").json()
    assert doc["health"]["serving_policy_version"] == 2 and doc["health"]["training"] == "running"
    points = doc["rewards"]["points"]
    assert [(p["session_id"], p["source"], p["value"]) for p in points] == [
        ("dash-0", "api", 0.0), ("dash-1", "api", 1.0), ("dash-2", "api", 0.5), ("dash-3", "api", 1.0)]
    assert [p["version"] for p in points] == [0, 0, 1, 1]
    assert {"policy_version": 1, "session": 2} in doc["rewards"]["version_starts"]
    by_version = {(v["policy_version"], v["source"]): v["mean"] for v in doc["rewards"]["by_version"]}
    assert by_version == {(0, "api"): 0.5, (1, "api"): 0.75}
    ok = [s for s in doc["training"]["steps"] if s["status"] == "ok"]
    assert [(s["policy_version"], s["samples"]) for s in ok] == [(1, 2), (2, 2)]
    assert {"loss", "kl", "clip_fraction", "train_seconds", "publish_seconds"} <= set(ok[0]["metrics"])
    assert doc["training"]["samples"] == {"pending": 0, "trained": 4, "dropped": {}}
    assert any("samples ready" in w for w in doc["training"]["waiting_for"])
    assert [v["policy_version"] for v in doc["versions"]] == [0, 1, 2]
    ck = doc["checkpoints"]  # one committed checkpoint per version, newest first; rollback is offline
    assert [(r["version"], r["kind"]) for r in ck["rows"]] == [(2, "step"), (1, "step"), (0, "base")]
    assert all(r["checkpoint"] for r in ck["rows"]) and "clawbridge rollback" in ck["note"]
    assert doc["config"]["metrics_key"] == "***" and doc["config"]["admin_key"] is None  # from a file, unset here
    # each installed backend's options as it would resolve them (defaults included), not only TOML sections
    assert doc["config"]["backends"]["fireworks"]["base_url"] == FireworksSettings().base_url
    assert trained.admin not in c.get("/dashboard/api/overview").text

    sessions = c.get("/dashboard/api/sessions").json()["sessions"]
    assert [s["session_id"] for s in sessions] == ["dash-3", "dash-2", "dash-1", "dash-0"]
    assert sessions[0]["status"] == "ended" and sessions[0]["turns"] == 1 and sessions[0]["reward"] == 1.0

    detail = c.get("/dashboard/api/sessions/dash-2").json()
    (turn,) = detail["turns"]
    assert turn["messages"] == [{"role": "user", "content": trained.questions["dash-2"]}]
    assert turn["answer"]["content"] == ANSWER and turn["policy_version"] == 1
    assert turn["rewards"] == [{"value": 0.5, "source": "api"}] and turn["latency_ms"] >= 0
    assert "prompt_token_ids" not in turn


def test_writes_need_the_csrf_token_and_reach_the_store(trained: TrainedProxy) -> None:
    c, csrf = login(trained)
    turn_id = c.get("/dashboard/api/sessions/dash-0").json()["turns"][0]["turn_id"]
    url = "/dashboard/api/sessions/dash-0/reward"
    r = c.post(url, json={"reward": 0.25, "turn_id": turn_id})
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
    r = c.post(url, json={"reward": 0.25, "turn_id": turn_id}, headers={"X-CSRF-Token": csrf + "x"})
    assert r.status_code == 403
    r = c.post("/dashboard/api/notes/1/delete", json={})  # deleting a note is a write like any other
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
    store = trained.proxy.state.store
    assert all(rw.source != "dashboard" for rw in store.session_rewards("dash-0"))
    r = c.post(url, json={"reward": 0.25, "turn_id": turn_id}, headers={"X-CSRF-Token": csrf})
    assert r.status_code == 200, r.text
    rewards = [(rw.turn_id, rw.value, rw.source) for rw in store.session_rewards("dash-0")]
    assert (turn_id, 0.25, "dashboard") in rewards  # committed before the 200
    # the admin key in a header is no ambient credential: no CSRF token needed
    r = httpx.post(trained.base + url, json={"reward": -1.0}, headers={"Authorization": f"Bearer {trained.admin}"})
    assert r.status_code == 200 and (None, -1.0, "dashboard") in [
        (rw.turn_id, rw.value, rw.source) for rw in store.session_rewards("dash-0")]


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/dashboard/api/sessions/dash-0/reward", b'{"reward": "high"}', 422),
        ("/dashboard/api/sessions/dash-0/reward", b'{"reward": 1e999}', 400),
        ("/dashboard/api/sessions/dash-0/reward", b'{"reward": NaN}', 400),
        ("/dashboard/api/sessions/dash-0/reward", b'{"reward": 1, "extra": 2}', 422),
        ("/dashboard/api/sessions/dash-0/reward", b'{"reward": 1, "turn_id": "turn_nope"}', 404),
        ("/dashboard/api/sessions/dash-0/reward", b"{not json", 400),
        ("/dashboard/api/sessions/dash-0/reward", b"[1, 2]", 400),
        ("/dashboard/api/sessions/nope/reward", b'{"reward": 1}', 404),
        ("/dashboard/api/sessions/nope/end", b"{}", 404),
        ("/dashboard/api/notes/1/delete", b"{}", 404),  # no judge here: notes are off
        ("/dashboard/api/notes/not-a-number/delete", b"{}", 422),
    ],
)
def test_bad_writes_get_a_clear_4xx(trained: TrainedProxy, path: str, body: bytes, status: int) -> None:
    c, csrf = login(trained)
    before = len(trained.proxy.state.store.session_rewards("dash-0"))
    r = c.post(path, content=body, headers={"X-CSRF-Token": csrf, "Content-Type": "application/json"})
    assert r.status_code == status and r.json()["error"]["message"], r.text
    assert len(trained.proxy.state.store.session_rewards("dash-0")) == before


def test_bad_reads_get_a_clear_4xx(trained: TrainedProxy) -> None:
    c, _ = login(trained)
    assert c.get("/dashboard/api/sessions?limit=0").status_code == 422
    assert c.get("/dashboard/api/sessions?status=bogus").status_code == 422
    assert c.get("/dashboard/api/sessions?limit=abc").status_code == 422
    r = c.get("/dashboard/api/sessions/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"


def test_one_time_link_works_once(trained: TrainedProxy) -> None:
    token = trained.proxy.app.state.dashboard.issue_link()
    c = httpx.Client(base_url=trained.base, follow_redirects=False)
    r = c.get(f"/dashboard/link/{token}")
    assert r.status_code == 303 and "HttpOnly" in r.headers["set-cookie"]
    assert c.get("/dashboard/api/overview").status_code == 200
    again = httpx.get(f"{trained.base}/dashboard/link/{token}")
    assert again.status_code == 401 and COOKIE not in again.headers.get("set-cookie", "")


def test_logout_ends_the_login(trained: TrainedProxy) -> None:
    c, csrf = login(trained)
    assert c.post("/dashboard/logout").status_code == 403  # CSRF: no token
    assert c.post("/dashboard/logout", headers={"X-CSRF-Token": csrf}).status_code == 303
    assert c.get("/dashboard/api/overview").status_code == 401


def test_metrics_parse_and_count_what_happened(trained: TrainedProxy) -> None:
    assert httpx.get(trained.base + "/metrics").status_code == 401
    assert httpx.get(trained.base + "/metrics", headers={"Authorization": f"Bearer {trained.client_key}"}).status_code == 401
    r = httpx.get(trained.base + "/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}

    def value(family: str, sample: str, **labels: str) -> float:
        matches = [s.value for s in families[family].samples
                   if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(matches) == 1, (family, sample, labels, families[family].samples)
        return float(matches[0])

    assert value("clawbridge_http_requests", "clawbridge_http_requests_total",
                 route="/v1/chat/completions", method="POST", status="200") == 4
    assert value("clawbridge_http_requests", "clawbridge_http_requests_total",
                 route="/rl/set_reward", method="POST", status="200") == 4
    assert value("clawbridge_http_request_seconds", "clawbridge_http_request_seconds_count",
                 route="/v1/chat/completions") == 4
    assert value("clawbridge_sessions", "clawbridge_sessions", status="ended") == 4
    assert value("clawbridge_tokens", "clawbridge_tokens_total", direction="out") > 0
    assert value("clawbridge_rewards", "clawbridge_rewards_total", source="api") == 4
    assert value("clawbridge_reward_value_sum", "clawbridge_reward_value_sum", source="api") == 2.5
    assert value("clawbridge_reward", "clawbridge_reward_bucket", source="api", le="0.0") == 1
    assert value("clawbridge_training_steps", "clawbridge_training_steps_total", status="ok") == 2
    assert value("clawbridge_step_publish_seconds", "clawbridge_step_publish_seconds_count") == 2
    assert value("clawbridge_samples_trained", "clawbridge_samples_trained_total") == 4
    assert value("clawbridge_samples_dropped", "clawbridge_samples_dropped_total", reason="stale") == 0
    assert value("clawbridge_judge_calls", "clawbridge_judge_calls_total", outcome="ok") == 0
    assert value("clawbridge_policy_version", "clawbridge_policy_version", kind="serving") == 2
    # an unknown path is counted under one label, not under what the client sent
    httpx.get(trained.base + "/no/such/path/12345")
    again = httpx.get(trained.base + "/metrics", headers={"Authorization": f"Bearer {trained.admin}"}).text
    assert "/no/such/path" not in again and 'route="unmatched"' in again
