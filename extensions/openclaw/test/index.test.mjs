// Unit tests for the compiled extension (index.js), driving register() with a fake OpenClaw api.
// Run: node --test test/   (from extensions/openclaw)
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import plugin, { buildHeaders, classifyTurn, DEFAULT_HEADERS, headerValue, resolveConfig } from "../index.js";

/** A fake `api` that records what the plugin registers and lets tests fire hooks. */
function fakeApi(pluginConfig) {
  const hooks = new Map();
  const providers = [];
  const warnings = [];
  const api = {
    pluginConfig,
    logger: { warn: (m) => warnings.push(m), debug: () => {} },
    registerProvider: (p) => providers.push(p),
    on: (name, handler) => {
      if (!hooks.has(name)) hooks.set(name, []);
      hooks.get(name).push(handler);
    },
  };
  const fire = (name, event, ctx) => {
    for (const handler of hooks.get(name) ?? []) handler(event, ctx);
  };
  return { api, hooks, providers, warnings, fire };
}

/** Wrap a recording stream function with the plugin's wrapStreamFn; returns the calls it saw. */
function wrapped(provider, kind = "wrapStreamFn") {
  const calls = [];
  const inner = (model, context, options) => {
    calls.push({ model, context, options });
    return "stream-result";
  };
  const fn = provider[kind]({ provider: provider.id, modelId: "tiny", streamFn: inner });
  return { fn, calls };
}

function setup(pluginConfig) {
  const f = fakeApi(pluginConfig);
  plugin.register(f.api);
  assert.equal(f.providers.length, 1);
  return { ...f, provider: f.providers[0] };
}

test("manifest, package.json and entry agree on ids", () => {
  const manifest = JSON.parse(readFileSync(new URL("../openclaw.plugin.json", import.meta.url), "utf8"));
  const pkg = JSON.parse(readFileSync(new URL("../package.json", import.meta.url), "utf8"));
  assert.equal(manifest.id, plugin.id);
  assert.deepEqual(manifest.providers, ["clawbridge"]);
  assert.deepEqual(pkg.openclaw.providers, ["clawbridge"]);
  assert.deepEqual(pkg.openclaw.extensions, ["./index.js"]);
  assert.equal(pkg.type, "module");
  assert.equal(manifest.activation.onStartup, true);
  assert.match(pkg.devDependencies.typescript, /^\d+\.\d+\.\d+$/, "TypeScript must be pinned exactly");
});

test("registers the clawbridge provider and the session hooks", () => {
  const { provider, hooks } = setup(undefined);
  assert.equal(provider.id, "clawbridge");
  assert.deepEqual(provider.auth, []);
  assert.equal(typeof provider.wrapStreamFn, "function");
  assert.equal(typeof provider.resolveTransportTurnState, "function");
  for (const name of ["before_model_resolve", "before_agent_run", "llm_input", "model_call_started"]) {
    assert.ok(hooks.has(name), `hook ${name} registered`);
  }
});

test("a user turn is main and carries the session key, trigger and request id", () => {
  const { provider, fire } = setup({});
  const ctx = { sessionId: "s1", sessionKey: "agent:main:explicit:s1", trigger: "user", runId: "r1" };
  fire("before_model_resolve", { prompt: "hi" }, ctx);
  const { fn, calls } = wrapped(provider);
  const out = fn("M", "C", { sessionId: "s1", requestId: "r1:model:1", headers: { Existing: "1" }, temperature: 0 });
  assert.equal(out, "stream-result");
  assert.equal(calls.length, 1);
  assert.equal(calls[0].model, "M");
  assert.equal(calls[0].context, "C");
  assert.equal(calls[0].options.temperature, 0);
  assert.deepEqual(calls[0].options.headers, {
    Existing: "1",
    "X-Session-Id": "agent:main:explicit:s1",
    "X-Turn-Type": "main",
    "X-Turn-Id": "r1:model:1",
    "X-Turn-Trigger": "user",
  });
});

test("manual trigger is main; heartbeat, cron, memory, overflow are side", () => {
  const { provider, fire } = setup({});
  const { fn, calls } = wrapped(provider);
  const cases = [
    ["manual", "main"],
    ["heartbeat", "side"],
    ["cron", "side"],
    ["memory", "side"],
    ["overflow", "side"],
    ["something-new", "side"],
  ];
  cases.forEach(([trigger, expected], i) => {
    fire("before_agent_run", { prompt: "p", messages: [] }, { sessionId: "s", sessionKey: "agent:main:main", trigger, runId: `run${i}` });
    fn(null, null, { sessionId: "s" });
    const headers = calls.at(-1).options.headers;
    assert.equal(headers["X-Turn-Type"], expected, trigger);
    assert.equal(headers["X-Turn-Trigger"], trigger);
    assert.equal(headers["X-Session-Id"], "agent:main:main");
  });
});

test("inter-session deliveries and internal system input are side even with trigger user", () => {
  const { provider, fire } = setup({});
  const { fn, calls } = wrapped(provider);
  fire("llm_input", { sessionId: "s" }, { sessionId: "s", sessionKey: "k", trigger: "user", runId: "a", inputProvenance: { kind: "inter_session", sourceSessionKey: "other" } });
  fn(null, null, { sessionId: "s" });
  assert.equal(calls.at(-1).options.headers["X-Turn-Type"], "side");
  fire("llm_input", { sessionId: "s" }, { sessionId: "s", trigger: "user", runId: "b", inputProvenance: { kind: "internal_system" } });
  fn(null, null, { sessionId: "s" });
  assert.equal(calls.at(-1).options.headers["X-Turn-Type"], "side");
  // A new run without provenance from an external user is main again; the key is kept.
  fire("llm_input", { sessionId: "s" }, { sessionId: "s", trigger: "user", runId: "c", inputProvenance: { kind: "external_user" } });
  fn(null, null, { sessionId: "s" });
  assert.equal(calls.at(-1).options.headers["X-Turn-Type"], "main");
  assert.equal(calls.at(-1).options.headers["X-Session-Id"], "k");
});

test("facts from several hooks of the same run merge; the event's sessionId is a fallback", () => {
  const { provider, fire } = setup({});
  const { fn, calls } = wrapped(provider);
  fire("before_model_resolve", {}, { sessionId: "s", runId: "r", trigger: "user" });
  fire("model_call_started", { sessionId: "s", sessionKey: "agent:x" }, { runId: "r", sessionKey: "agent:x" });
  fn(null, null, { sessionId: "s" });
  const h = calls.at(-1).options.headers;
  assert.equal(h["X-Session-Id"], "agent:x");
  assert.equal(h["X-Turn-Type"], "main");
});

test("an unknown session sends no session id and is side", () => {
  const { provider } = setup({});
  const { fn, calls } = wrapped(provider);
  fn(null, null, { sessionId: "never-seen" });
  fn(null, null, undefined);
  for (const call of calls) {
    const h = call.options.headers;
    assert.equal(h["X-Session-Id"], undefined);
    assert.equal(h["X-Turn-Type"], "side");
    assert.equal(h["X-Turn-Trigger"], "unknown");
    assert.match(h["X-Turn-Id"], /^[0-9a-f-]{36}$/);
  }
  assert.notEqual(calls[0].options.headers["X-Turn-Id"], calls[1].options.headers["X-Turn-Id"]);
});

test("direct completions (wrapSimpleCompletionStreamFn) are always side", () => {
  const { provider, fire } = setup({});
  fire("before_model_resolve", {}, { sessionId: "s", sessionKey: "k", trigger: "user", runId: "r" });
  const { fn, calls } = wrapped(provider, "wrapSimpleCompletionStreamFn");
  fn(null, null, { sessionId: "s" });
  const h = calls[0].options.headers;
  assert.equal(h["X-Turn-Type"], "side");
  assert.equal(h["X-Turn-Trigger"], "completion");
  assert.equal(h["X-Session-Id"], "k");
});

test("no stream function to wrap means no wrapper", () => {
  const { provider } = setup({});
  assert.equal(provider.wrapStreamFn({ provider: "clawbridge", modelId: "m" }), undefined);
});

test("resolveTransportTurnState returns the same headers keyed on the transport's turn id", () => {
  const { provider, fire } = setup({});
  fire("before_model_resolve", {}, { sessionId: "s", sessionKey: "k", trigger: "heartbeat", runId: "r" });
  const state = provider.resolveTransportTurnState({ provider: "clawbridge", modelId: "m", sessionId: "s", turnId: "t-1", attempt: 1, transport: "stream" });
  assert.deepEqual(state.headers, { "X-Session-Id": "k", "X-Turn-Type": "side", "X-Turn-Id": "t-1", "X-Turn-Trigger": "heartbeat" });
});

test("header names and provider id are configurable; our headers replace same-named ones", () => {
  const { provider, fire } = setup({
    providerId: "my-proxy",
    headers: { sessionId: "X-CB-Session", turnType: "X-CB-Type", turnId: "X-CB-Turn", turnTrigger: "X-CB-Trigger" },
  });
  assert.equal(provider.id, "my-proxy");
  fire("before_model_resolve", {}, { sessionId: "s", sessionKey: "k", trigger: "user", runId: "r" });
  const { fn, calls } = wrapped(provider);
  fn(null, null, { sessionId: "s", requestId: "q", headers: { "x-cb-session": "spoofed", "X-Session-Id": "left-alone" } });
  assert.deepEqual(calls[0].options.headers, {
    "X-Session-Id": "left-alone",
    "X-CB-Session": "k",
    "X-CB-Type": "main",
    "X-CB-Turn": "q",
    "X-CB-Trigger": "user",
  });
});

test("invalid or colliding config falls back to defaults with a warning", () => {
  const warnings = [];
  const cfg = resolveConfig({ providerId: "Bad Id!", headers: { sessionId: "bad header\r\n" }, maxTrackedSessions: -1 }, (m) => warnings.push(m));
  assert.equal(cfg.providerId, "clawbridge");
  assert.deepEqual(cfg.headers, DEFAULT_HEADERS);
  assert.equal(cfg.maxTrackedSessions, 1024);
  assert.equal(warnings.length, 2);
  const collide = resolveConfig({ headers: { turnId: "x-session-id" } }, (m) => warnings.push(m));
  assert.deepEqual(collide.headers, DEFAULT_HEADERS);
  assert.equal(warnings.length, 3);
});

test("the session map is bounded, evicting the least recently updated session", () => {
  const { provider, fire } = setup({ maxTrackedSessions: 2 });
  const { fn, calls } = wrapped(provider);
  for (const s of ["a", "b", "c"]) fire("before_model_resolve", {}, { sessionId: s, sessionKey: `key-${s}`, trigger: "user", runId: s });
  fn(null, null, { sessionId: "a" });
  fn(null, null, { sessionId: "c" });
  assert.equal(calls[0].options.headers["X-Session-Id"], undefined);
  assert.equal(calls[1].options.headers["X-Session-Id"], "key-c");
});

test("header values are single-line printable ASCII", () => {
  assert.equal(headerValue("agent:main:main"), "agent:main:main");
  assert.equal(headerValue("a\r\nX-Evil: 1"), "a%0D%0AX-Evil: 1");
  assert.equal(headerValue("café"), "caf%C3%A9");
  assert.equal(headerValue("100%"), "100%25");
  const h = buildHeaders(DEFAULT_HEADERS, { sessionKey: "k\n", trigger: "user" }, "t");
  for (const value of Object.values(h)) assert.match(value, /^[\x20-\x7e]*$/);
});

test("classifyTurn needs positive evidence for main", () => {
  assert.equal(classifyTurn(undefined), "side");
  assert.equal(classifyTurn({}), "side");
  assert.equal(classifyTurn({ trigger: "user" }), "main");
  assert.equal(classifyTurn({ trigger: "user", provenanceKind: "external_user" }), "main");
  assert.equal(classifyTurn({ trigger: "manual", provenanceKind: "inter_session" }), "side");
});

test("index.js does not touch fetch", () => {
  const source = readFileSync(new URL("../index.js", import.meta.url), "utf8");
  assert.doesNotMatch(source, /globalThis\.fetch|\bfetch\s*=/);
});

test("agentAsUser sends the agent id as X-User-Id; off by default", () => {
  const ctx = { sessionId: "s1", sessionKey: "agent:work:main", trigger: "user", runId: "r1" };
  const off = setup({});
  off.fire("before_model_resolve", {}, ctx);
  const plain = wrapped(off.provider);
  plain.fn("M", "C", { sessionId: "s1", requestId: "q1" });
  assert.equal(plain.calls[0].options.headers["X-User-Id"], undefined);

  const on = setup({ agentAsUser: true });
  on.fire("before_model_resolve", {}, ctx);
  const { fn, calls } = wrapped(on.provider);
  fn("M", "C", { sessionId: "s1", requestId: "q1" });
  assert.equal(calls[0].options.headers["X-User-Id"], "work");
  // The hook's own agentId wins over the session key, and survives a new run of the session.
  on.fire("before_agent_run", {}, { ...ctx, agentId: "home", runId: "r2" });
  on.fire("llm_input", {}, { sessionId: "s1", runId: "r3", trigger: "user" });
  fn("M", "C", { sessionId: "s1", requestId: "q2" });
  assert.equal(calls[1].options.headers["X-User-Id"], "home");
  assert.equal(calls[1].options.headers["X-Session-Id"], "agent:work:main");
  // Transport turn state carries it too; an unknown session sends none.
  const state = on.provider.resolveTransportTurnState({ sessionId: "s1", turnId: "t", attempt: 1, transport: "stream" });
  assert.equal(state.headers["X-User-Id"], "home");
  fn("M", "C", { sessionId: "other", requestId: "q3" });
  assert.equal(calls[2].options.headers["X-User-Id"], undefined);
});

test("agentAsUser: a renamed header, and a non-boolean value is ignored with a warning", () => {
  const warnings = [];
  assert.equal(resolveConfig({ agentAsUser: "yes" }, (m) => warnings.push(m)).agentAsUser, false);
  assert.match(warnings[0], /agentAsUser/);
  const cfg = resolveConfig({ agentAsUser: true, headers: { userId: "X-Agent" } });
  const h = buildHeaders(cfg.headers, { sessionKey: "agent:a.b:main", trigger: "user" }, "t", false, cfg.agentAsUser);
  assert.equal(h["X-Agent"], "a.b");
  assert.equal(buildHeaders(cfg.headers, { sessionKey: "plain-key" }, "t", false, true)["X-Agent"], undefined);
});
