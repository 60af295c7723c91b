"""Prometheus metrics for `/metrics` (text format, `prometheus-client`).

Two sources, one registry per app (so two apps in one process never share counters):
- `HttpMetrics`, a pure ASGI middleware: requests by route template and status, and a latency
  histogram per route (for a streamed answer: until its last byte). Route labels are the app's
  route templates (`/s/{session_id}/v1/chat/completions`), never raw paths, so label cardinality
  stays bounded whatever clients send; unmatched paths are `unmatched`.
- `StoreCollector`, read at scrape time from the store (`clawbridge.store.observe`): sessions,
  turns, tokens in/out, rewards by source (count, sum, histogram), training steps by status,
  step / train / publish time histograms, samples pending, trained and dropped by reason, judge
  calls. Derived from committed rows, so they survive restarts, count what another process
  wrote, and cost nothing on the request path.

Invariant: a scrape never writes and never raises for an empty store.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from clawbridge.store import Store
from clawbridge.store.observe import ObserveStore

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

REWARD_BUCKETS: tuple[float, ...] = (-1.0, -0.5, 0.0, 0.5, 1.0)
SECONDS_BUCKETS: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
LATENCY_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class HttpMetrics:
    """ASGI middleware counting requests and timing them per route template."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.requests = metrics.requests
        self.latency = metrics.latency

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            label = str(getattr(route, "path", None) or "unmatched")
            self.requests.labels(label, str(scope.get("method", "")), str(status[0])).inc()
            self.latency.labels(label).observe(time.perf_counter() - start)


def _histogram(name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=labels)


def _buckets(bounds: Iterable[float], cumulative: list[int], count: int) -> list[tuple[str, float]]:
    out = [(repr(float(b)), float(c)) for b, c in zip(bounds, cumulative, strict=True)]
    out.append(("+Inf", float(count)))
    return out


class StoreCollector(Collector):
    """Store-derived metrics, computed at each scrape."""

    def __init__(self, store: Store, serving_version: Callable[[], int] | None = None) -> None:
        self.observe = ObserveStore(store)
        self.serving_version = serving_version

    def collect(self) -> Iterable[Metric]:
        t = self.observe.totals(REWARD_BUCKETS, SECONDS_BUCKETS)
        sessions = GaugeMetricFamily("clawbridge_sessions", "Sessions in the store, by status.", labels=["status"])
        for status in ("active", "ended"):
            sessions.add_metric([status], t["sessions"].get(status, 0))
        yield sessions
        turns = CounterMetricFamily("clawbridge_turns", "Recorded model calls, by turn type and status.",
                                    labels=["turn_type", "status"])
        for turn_type, status, n in t["turns"]:
            turns.add_metric([turn_type, status], n)
        yield turns
        tokens = CounterMetricFamily("clawbridge_tokens", "Tokens recorded: prompt (in) and completion (out).",
                                     labels=["direction"])
        tokens.add_metric(["in"], t["tokens"][0])
        tokens.add_metric(["out"], t["tokens"][1])
        yield tokens
        # Reward values can be negative, so the histogram has no _sum/_count (Prometheus rule);
        # the count and the sum are their own families.
        rewards = _histogram("clawbridge_reward", "Accepted reward values by source (api, cli, judge, ...).",
                             ["source"])
        n_rewards = CounterMetricFamily("clawbridge_rewards", "Accepted rewards, by source.", labels=["source"])
        sum_rewards = GaugeMetricFamily("clawbridge_reward_value_sum", "Sum of accepted reward values, by source.",
                                        labels=["source"])
        for source, (cumulative, count, total) in sorted(t["rewards"].items()):
            rewards.add_metric([source], _buckets(REWARD_BUCKETS, cumulative, count), None)
            n_rewards.add_metric([source], count)
            sum_rewards.add_metric([source], total)
        yield rewards
        yield n_rewards
        yield sum_rewards
        steps = CounterMetricFamily("clawbridge_training_steps", "Training steps, by outcome.", labels=["status"])
        for status in ("ok", "failed", "running"):
            steps.add_metric([status], t["steps"].get(status, 0))
        yield steps
        for key, name, doc in (
            ("seconds", "clawbridge_step_seconds", "Wall time of committed steps (train + publish)."),
            ("train_seconds", "clawbridge_step_train_seconds", "train_step time of committed steps."),
            ("publish_seconds", "clawbridge_step_publish_seconds", "publish time of committed steps."),
        ):
            cumulative, count, total = t["step_seconds"][key]
            h = _histogram(name, doc, [])
            h.add_metric([], _buckets(SECONDS_BUCKETS, cumulative, count), total)
            yield h
        version = GaugeMetricFamily("clawbridge_policy_version", "Policy version: last trained, and serving.",
                                    labels=["kind"])
        if t["policy_version"] is not None:
            version.add_metric(["trained"], float(t["policy_version"]))
        if self.serving_version is not None:
            version.add_metric(["serving"], float(self.serving_version()))
        yield version
        samples = t["samples"]
        pending = GaugeMetricFamily("clawbridge_samples_pending", "Samples waiting to be trained.")
        pending.add_metric([], samples["pending"])
        yield pending
        trained = CounterMetricFamily("clawbridge_samples_trained", "Samples consumed by a committed step.")
        trained.add_metric([], samples["trained"])
        yield trained
        dropped = CounterMetricFamily("clawbridge_samples_dropped", "Samples dropped, by reason.", labels=["reason"])
        for reason in sorted(set(samples["dropped"]) | {"stale", "no_reward", "empty", "no_signal", "private"}):
            dropped.add_metric([reason], samples["dropped"].get(reason, 0))
        yield dropped
        votes = CounterMetricFamily("clawbridge_judge_calls", "Judge calls (votes), by outcome.", labels=["outcome"])
        for outcome in ("ok", "failed"):
            votes.add_metric([outcome], t["judge_votes"].get(outcome, 0))
        yield votes
        judgements = GaugeMetricFamily("clawbridge_judgements", "Judged turns, by status.", labels=["status"])
        for status, n in sorted(t["judgements"].items()):
            judgements.add_metric([status], n)
        yield judgements


class PrivacyCollector(Collector):
    """What the privacy filter masked since start-up, by where (train, judge) and kind; never text
    (`clawbridge.privacy.guard.PrivacyGuard.status`). Turns dropped as private are
    `clawbridge_samples_dropped{reason="private"}`."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.status = status

    def collect(self) -> Iterable[Metric]:
        masked = CounterMetricFamily("clawbridge_privacy_masked", "Findings the privacy filter replaced by a "
                                     "placeholder before sending (since start-up), by where and kind.",
                                     labels=["where", "kind"])
        for where, kinds in sorted(self.status()["masked"].items()):
            for kind, n in sorted(kinds.items()):
                masked.add_metric([where, kind], n)
        yield masked


class Metrics:
    """The registry of one app: HTTP middleware metrics plus the store collector (and the privacy
    filter's counts where it is on)."""

    def __init__(self, store: Store, serving_version: Callable[[], int] | None = None,
                 privacy: Callable[[], dict[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StoreCollector(store, serving_version))
        if privacy is not None:
            self.registry.register(PrivacyCollector(privacy))
        self.requests = Counter("clawbridge_http_requests", "HTTP requests answered, by route and status.",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram("clawbridge_http_request_seconds",
                                 "Time from request to last response byte, by route.", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
