// clawbridge dashboard: polls /dashboard/api/* and renders with DOM text nodes only (never
// innerHTML with data), so recorded text cannot inject markup. Writes send the login's CSRF token.
"use strict";
const POLL_MS = 2000;
const COLORS = {api: "#2563eb", judge: "#d97706", dashboard: "#059669", cli: "#7c3aed"};
const csrf = () => document.querySelector('meta[name="csrf-token"]').content;

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.appendChild(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
  }
  return e;
}
function fill(id, ...children) {
  const target = document.getElementById(id);
  target.replaceChildren(...children.filter((c) => c !== null && c !== undefined));
}
function num(v, digits) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  return Number.isInteger(v) ? String(v) : v.toFixed(digits === undefined ? 3 : digits);
}
function age(seconds) {
  if (seconds < 60) return `${Math.round(seconds)} s`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min`;
  if (seconds < 86400) return `${(seconds / 3600).toFixed(1)} h`;
  return `${(seconds / 86400).toFixed(1)} d`;
}
// Text with a line-break chance (<wbr>) inside a long word (12+ characters: a path, an option name)
// after . _ / , : = or - where a letter, / or ~ follows, so it wraps there and never inside a word or
// a number (the CSS forbids every other break inside a word).
function breakable(text) {
  const frag = document.createDocumentFragment();
  for (const word of String(text).split(/(\s+)/)) {
    word.split(word.length < 12 ? /(?!)/ : /(?<=[._\/,:=-])(?=[A-Za-z\/~])/).forEach((part, i) => {
      if (i) frag.appendChild(document.createElement("wbr"));
      frag.appendChild(document.createTextNode(part));
    });
  }
  return frag;
}
function table(headers, rows) {
  const cell = (tag, c) => el(tag, {}, typeof c === "string" ? breakable(c) : c);
  return el("div", {class: "tablewrap"}, el("table", {},
    el("thead", {}, el("tr", {}, ...headers.map((h) => cell("th", h)))),
    el("tbody", {}, ...rows.map((r) => el("tr", {}, ...r.map((c) => cell("td", c)))))));
}
// Nested configuration sections as one row per option: `backends.local.engine`.
function flatten(obj, prefix) {
  return Object.entries(obj).flatMap(([k, v]) => (v && typeof v === "object" && !Array.isArray(v))
    ? flatten(v, `${prefix}${k}.`) : [[`${prefix}${k}`, JSON.stringify(v)]]);
}
async function getJSON(url) {
  const r = await fetch(url, {credentials: "same-origin", headers: {Accept: "application/json"}});
  if (r.status === 401) { location.reload(); throw new Error("logged out"); }
  if (!r.ok) throw new Error(`${url}: ${r.status}`);
  return r.json();
}
async function post(url, body) {
  const r = await fetch(url, {method: "POST", credentials: "same-origin",
    headers: {"Content-Type": "application/json", "X-CSRF-Token": csrf()}, body: JSON.stringify(body || {})});
  const doc = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error((doc.error && doc.error.message) || `HTTP ${r.status}`);
  return doc;
}
function setStatus(text, bad) {
  const s = document.getElementById("status");
  s.textContent = text; s.className = bad ? "bad" : "ok";
}
function poll(fn) {
  const run = async () => {
    try { await fn(); setStatus(`updated ${new Date().toLocaleTimeString()}`, false); }
    catch (e) { setStatus(`update failed: ${e.message}`, true); }
    setTimeout(run, POLL_MS);
  };
  run();
}

// ------------------------------------------------------------------ overview page
function renderRewards(r) {
  const sources = [...new Set(r.points.map((p) => p.source))].sort();
  drawChart(document.getElementById("reward-chart"), {
    series: sources.map((s) => ({name: s, color: COLORS[s] || "#64748b", line: false,
      points: r.points.filter((p) => p.source === s).map((p) => [p.session, p.value])})),
    vlines: r.version_starts.filter((v) => v.policy_version > 0).map((v) => ({x: v.session - 0.5, label: `v${v.policy_version}`})),
    xlabel: "session (oldest → newest)", yzero: true, empty: "no rewards yet",
  });
  const vs = [...new Set(r.by_version.map((p) => p.source))].sort();
  drawChart(document.getElementById("version-chart"), {
    series: vs.map((s) => ({name: s, color: COLORS[s] || "#64748b", line: true,
      points: r.by_version.filter((p) => p.source === s).map((p) => [p.policy_version, p.mean])})),
    xlabel: "policy version", yzero: true, empty: "no turn-level rewards yet",
  });
}
function renderTraining(t) {
  fill("waiting", el("ul", {}, ...t.waiting_for.map((w) => el("li", {}, w))));
  const dropped = Object.entries(t.samples.dropped).map(([k, v]) => `${k} ${v}`).join(", ") || "none";
  fill("samples", el("span", {class: "pill"}, `pending ${t.samples.pending}`),
       el("span", {class: "pill"}, `trained ${t.samples.trained}`),
       el("span", {class: "pill"}, `dropped: ${dropped}`));
  const ok = t.steps.filter((s) => s.status === "ok");
  const series = (key, name, color) => ({name, color, line: true,
    points: ok.filter((s) => typeof s.metrics[key] === "number").map((s) => [s.step, s.metrics[key]])});
  // one small chart per metric, each on its own axis: on one shared axis a kl of 0.001 lay flat under
  // the clip fraction, and the loss's scale hid both
  for (const [id, key, name, color] of [["loss-chart", "loss", "loss", "#dc2626"],
      ["reward-mean-chart", "reward_mean", "reward mean", "#d97706"], ["kl-chart", "kl", "kl", "#2563eb"],
      ["clip-chart", "clip_fraction", "clip fraction", "#059669"]]) {
    drawChart(document.getElementById(id), {series: [series(key, name, color)], xlabel: "step", height: 170, legend: false,
                                            empty: ok.length ? `no ${name} reported` : "no training steps yet"});
  }
  fill("steps", table(["step", "status", "version", "samples", "loss", "kl", "clip", "tokens", "train s", "publish s", "error"],
    t.steps.slice(-20).reverse().map((s) => [String(s.step), s.status, num(s.policy_version), String(s.samples),
      num(s.metrics.loss, 4), num(s.metrics.kl, 4), num(s.metrics.clip_fraction), num(s.metrics.tokens ?? s.metrics.loss_tokens),
      num(s.metrics.train_seconds, 2), num(s.metrics.publish_seconds, 2), s.error || ""])));
  fill("dropped", t.dropped_recent.length === 0 ? el("p", {class: "muted"}, "no sample dropped") :
    table(["turn", "session", "version", "reason"], t.dropped_recent.map((d) =>
      [d.turn_id, el("a", {href: `/dashboard/sessions/${encodeURIComponent(d.session_id)}`}, d.session_id),
       String(d.policy_version), d.reason])));
}
function renderSessions(doc) {
  fill("sessions", table(["session", "status", "turns", "reward", "version", "age", "end reason"],
    doc.sessions.map((s) => [el("a", {href: `/dashboard/sessions/${encodeURIComponent(s.session_id)}`, class: "sid"}, s.session_id),
      s.status, String(s.turns), s.reward === null ? "–" : `${num(s.reward)} (${s.rewards})`, num(s.last_policy_version),
      age(doc.now - s.created_at), s.end_reason || ""])));
  fill("sessions-total", `${doc.total} session(s), newest ${doc.sessions.length} shown`);
}
function renderHealth(doc) {
  const h = doc.health;
  const e = h.engine;  // the KV budget of an engine that reports one (torch engine), else null
  const kv = e ? `${Math.round(e.kv_used_fraction * 100)}% of ${e.kv_budget_tokens} tokens, ${e.running} running, ${e.waiting} waiting` : "–";
  const strip = [["model", h.model], ["backend", h.backend], ["serving version", `v${h.serving_policy_version}`],
    ["training", h.training], ["judge", h.judge], ["sessions", String(h.sessions)], ["up", age(h.uptime_s)], ["KV budget", kv]];
  fill("health", el("div", {class: "strip"}, ...strip.map(([k, v]) =>
    el("div", {}, el("span", {class: "label"}, k), el("span", {class: "value"}, breakable(v))))));
  fill("versions", table(["version", "published by step", "published", "turns served"],
    doc.versions.map((v) => [`v${v.policy_version}`, num(v.step),
      v.published_at ? new Date(v.published_at * 1000).toLocaleString() : (v.policy_version === 0 ? "base" : "–"),
      String(v.turns)])));
  const ck = doc.checkpoints;
  const serve = (r) => (!ck.rollback || r.pruned || r.version === h.serving_policy_version) ? "" :
    el("button", {class: "serve-button", "data-version": String(r.version), onclick: async () => {
      const action = r.version < h.serving_policy_version ? "rollback" : "promote";
      try { const out = await post(`/dashboard/api/promotion/${action}`, {version: r.version});
            setStatus(`v${out.serving_version} serves now (was v${out.previous})` +
                      (out.held ? "; training holds until resumed" : ""), false); }
      catch (e) { setStatus(`${action} refused: ${e.message}`, true); }
    }}, "serve");
  fill("checkpoints", el("div", {},
    table(["version", "kind", "step", "serves weights of", "committed", "checkpoint", ""],
      ck.rows.map((r) => [`v${r.version}`, r.kind, num(r.step),
        r.source_version === null ? "–" : `v${r.source_version}`,
        r.committed_at ? new Date(r.committed_at * 1000).toLocaleString() : "–",
        r.pruned ? `pruned (${r.checkpoint})` : (r.checkpoint || "–"), serve(r)])),
    el("p", {class: "muted"}, ck.note)));
  renderPromotion(doc.promotion);
  fill("config", table(["option", "value"], flatten(doc.config, "")));
  renderTalk(doc.notes, doc.promotion);
}
function renderPromotion(p) {
  if (!p) { fill("promotion", el("p", {class: "muted"}, "promotion is not set up")); return; }
  const resume = p.held_version === null || p.held_version === undefined ? [] : [
    el("button", {class: "resume-button", onclick: async () => {
      try { const out = await post("/dashboard/api/promotion/resume", {});
            setStatus(`training resumed from v${out.serving_version}`, false); }
      catch (e) { setStatus(`resume refused: ${e.message}`, true); }
    }}, "resume training")];
  fill("promotion", el("div", {}, el("ul", {}, ...p.lines.map((l) => el("li", {}, l))), ...resume));
  fill("decisions", p.decisions.length === 0 ? el("p", {class: "muted"}, "no decision yet") :
    table(["version", "verdict", "by", "score", "incumbent", "reason"],
      p.decisions.map((d) => [`v${d.version}`, d.verdict, d.source, num(d.score),
        d.incumbent_version === null ? "–" : `v${d.incumbent_version}: ${num(d.incumbent_score)}`, d.reason])));
  fill("evals", p.evals.length === 0 ? el("p", {class: "muted"}, "no version evaluated yet") :
    table(["version", "set", "passed", "pass rate (95% CI)", "score", "mean judge score", "mean answer tokens", "seconds"],
      p.evals.map((e) => [`v${e.version}`, e.source, `${e.passed}/${e.items}`,
        `${num(e.pass_rate)} (${num(e.ci_low)} to ${num(e.ci_high)})`, num(e.score), num(e.mean_judge_score),
        num(e.mean_answer_tokens, 1), num(e.seconds, 2)])));
}
function renderTalk(notes, p) {
  const good = p && p.still_good;
  const line = document.getElementById("still-good");
  line.textContent = good || "still good? not checked: the capability probe is off (promotion_mode, capability_probe)";
  line.className = good && good.startsWith("still good? no:") ? "stillgood no" : "stillgood";
  if (notes === null || notes === undefined) {
    fill("notes", el("p", {class: "muted"}, "notes are off on this server (notes = false)"));
    return;
  }
  const remove = (n) => el("button", {class: "delete-note", "data-note-id": String(n.note_id), onclick: async () => {
    try { await post(`/dashboard/api/notes/${n.note_id}/delete`, {}); setStatus(`note ${n.note_id} deleted`, false); }
    catch (e) { setStatus(`delete refused: ${e.message}`, true); }
  }}, "delete");
  fill("notes", notes.length === 0 ? el("p", {class: "muted"}, "no note yet: a note is made when the judge reads a correction") :
    table(["user", "note", "correction", "met since", "stable", "state", ""], notes.map((n) => {
      const w = n.words;
      return [w.owner, w.text, w.corrections, w.met, w.stable, w.state, remove(n)];
    })));
}
const SPARKS = "▁▂▃▄▅▆▇█";
function sparkline(values) {
  if (!values.length) return "";
  const lo = Math.min(...values), span = Math.max(...values) - lo;
  return values.map((v) => SPARKS[span === 0 ? 0 : Math.round((v - lo) / span * (SPARKS.length - 1))]).join("");
}
function adapterCells(lane) {
  if (!lane) return ["shared policy", "–"];
  const served = lane.serving_version === null ? "not trained yet" : `v${lane.serving_version} (not gated)`;
  const rehearsed = lane.rehearsed ? `, ${lane.rehearsed} facts rehearsed per step` : "";
  const t = lane.reward_trend;
  return [`${served}, ${lane.steps.ok} step(s)${rehearsed}${lane.in_step ? ", training" : ""}`,
          t.length ? `${num(t[0])} → ${num(t[t.length - 1])} ${sparkline(t)}` : "–"];
}
function renderUsers(users, lanes) {
  const head = ["user", "status", "sessions", "turns", "pending turns", "mean reward (n)"];
  fill("users", users.length === 0 ? el("p", {class: "muted"}, "no sessions yet") :
    table(lanes ? [...head, "own adapter", "step reward trend"] : head,
      users.map((u) => [u.user === null ? "(no user)" : u.user, u.status || "–", String(u.sessions), String(u.turns),
        String(u.pending_turns), u.mean_reward === null ? "–" : `${num(u.mean_reward)} (${u.rewards})`,
        ...(lanes ? (u.user === null ? ["shared policy", "–"] : adapterCells(lanes[u.user])) : [])])));
}
async function overviewPage() {
  poll(async () => {
    const [doc, sessions] = await Promise.all([getJSON("/dashboard/api/overview"), getJSON("/dashboard/api/sessions?limit=30")]);
    renderRewards(doc.rewards); renderTraining(doc.training); renderSessions(sessions); renderHealth(doc); renderUsers(doc.users, doc.lanes);
    document.body.dataset.loaded = "1";
  });
}

// ------------------------------------------------------------------ session page
function messageBlock(m, cls) {
  const calls = (m.tool_calls || []).map((c) => el("div", {class: "toolcall"}, `→ ${c.name}(${c.arguments ?? ""})`));
  return el("div", {class: `msg ${cls || m.role}`}, el("span", {class: "role"}, m.role + (m.tool_call_id ? ` ${m.tool_call_id}` : "")),
            m.reasoning ? el("div", {class: "reasoning"}, m.reasoning) : null,
            el("div", {class: "content"}, m.content || ""), ...calls);
}
function turnBlock(t, sessionId) {
  const votes = t.judge.votes.length === 0 ? null : el("div", {class: "judge"}, "judge votes: ",
    ...t.judge.votes.map((v) => el("span", {class: "pill", title: v.hint || v.error || ""},
      `#${v.idx} (try ${v.attempt}): ${v.score === null ? "failed" : v.score}`)),
    t.judge.hint ? el("div", {class: "hint"}, `hint: ${t.judge.hint}`) : null);
  const rewards = t.rewards.map((r) => el("span", {class: "pill reward"}, `${r.source} ${num(r.value)}`));
  const input = el("input", {type: "number", step: "0.1", value: "1", class: "reward-input", "aria-label": "reward"});
  const button = el("button", {class: "reward-button", onclick: async () => {
    try { await post(`/dashboard/api/sessions/${encodeURIComponent(sessionId)}/reward`, {reward: Number(input.value), turn_id: t.turn_id}); setStatus("reward saved", false); }
    catch (e) { setStatus(`reward refused: ${e.message}`, true); }
  }}, "set reward");
  return el("section", {class: `turn ${t.turn_type}`, "data-turn-id": t.turn_id},
    el("h3", {}, `#${t.seq} ${t.turn_type} · ${t.status} · policy v${t.policy_version} · ${num(t.latency_ms, 0)} ms` +
       (t.ttft_ms !== null ? ` (first token ${num(t.ttft_ms, 0)} ms)` : "") +
       ` · ${t.prompt_tokens} → ${t.completion_tokens} tokens · ${t.finish_reason || ""}`),
    el("details", {}, el("summary", {}, `request: ${t.messages.length} message(s)`), ...t.messages.map((m) => messageBlock(m))),
    messageBlock({...t.answer, role: "answer"}, "answer"),
    t.next_state ? el("div", {class: "next"}, el("span", {class: "role"}, `next state (${t.next_state.kind})`),
                      ...t.next_state.messages.map((m) => messageBlock(m))) : null,
    votes, el("div", {class: "rewards"}, "rewards: ", ...(rewards.length ? rewards : ["none"]), " ", input, button));
}
async function sessionPage(sessionId) {
  document.getElementById("end-session").addEventListener("click", async () => {
    try { await post(`/dashboard/api/sessions/${encodeURIComponent(sessionId)}/end`); setStatus("session ended", false); }
    catch (e) { setStatus(`end refused: ${e.message}`, true); }
  });
  document.getElementById("session-reward-button").addEventListener("click", async () => {
    const v = Number(document.getElementById("session-reward").value);
    try { await post(`/dashboard/api/sessions/${encodeURIComponent(sessionId)}/reward`, {reward: v}); setStatus("session reward saved", false); }
    catch (e) { setStatus(`reward refused: ${e.message}`, true); }
  });
  let shown = "";
  poll(async () => {
    const s = await getJSON(`/dashboard/api/sessions/${encodeURIComponent(sessionId)}`);
    fill("session-info", table(["status", "source", "task", "end reason", "turns", "session rewards", "age"],
      [[s.status, s.source, s.task_id || "–", s.end_reason || "–", String(s.turns.length),
        s.session_rewards.map((r) => `${r.source} ${num(r.value)}`).join(", ") || "none", age(s.now - s.created_at)]]));
    const key = JSON.stringify(s.turns) + s.status;
    if (key !== shown) {  // keep typed reward values while nothing changed
      shown = key;
      fill("turns", ...s.turns.map((t) => turnBlock(t, sessionId)));
    }
    document.body.dataset.loaded = "1";
  });
}

document.addEventListener("DOMContentLoaded", () => {
  const logout = document.getElementById("logout");
  if (logout) logout.addEventListener("click", async () => {
    await fetch("/dashboard/logout", {method: "POST", credentials: "same-origin", headers: {"X-CSRF-Token": csrf()}});
    location.href = "/dashboard";
  });
  const page = document.body.dataset.page;
  if (page === "overview") overviewPage();
  else if (page === "session") sessionPage(document.body.dataset.sessionId);
});
