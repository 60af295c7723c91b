/**
 * clawbridge extension for OpenClaw (2026.9.x).
 *
 * Owns a model provider (default id `clawbridge`) whose requests go to a local clawbridge proxy,
 * and adds four headers to every model request of that provider:
 *
 *   X-Session-Id    the OpenClaw session key (e.g. `agent:main:main`)
 *   X-Turn-Type     `main` for a turn started by an external user, `side` for everything else
 *   X-Turn-Id       one id per model request (stable across the transport's retries)
 *   X-Turn-Trigger  the run trigger OpenClaw reported (`user`, `manual`, `heartbeat`, `cron`,
 *                   `memory`, `overflow`, ...), or `completion` for direct completions
 *
 * and, with `agentAsUser: true` in the plugin config, a fifth:
 *
 *   X-User-Id       the OpenClaw agent id (`main` of `agent:main:main`): clawbridge records each
 *                   agent as its own user (the server needs `trust_user_header = true`)
 *
 * Invariants:
 * - No global patching: headers travel only through the provider hooks OpenClaw gives us
 *   (`wrapStreamFn`, `wrapSimpleCompletionStreamFn`, `resolveTransportTurnState`), so they
 *   reach the wire exactly for this provider's requests and never for any other provider.
 * - The stream functions only see OpenClaw's session *id*; the session *key* and the trigger come
 *   from agent hooks (`before_model_resolve`, `before_agent_run`, `llm_input`, `model_call_started`)
 *   and are kept in a bounded map keyed by session id (runs in one session are serialized, so the
 *   latest run's facts are the current call's facts).
 * - `main` requires positive evidence: trigger `user` or `manual` and an input provenance that is
 *   not an inter-session delivery or an internal system message. Unknown means `side`.
 * - When nothing is known about a call's session, no X-Session-Id is sent (clawbridge then falls
 *   back to the `Runtime: ... session=<key>` line in the prompt) and the turn is `side`.
 * - Header values are always single-line printable ASCII (other characters are percent-encoded),
 *   so a header can never make the request fail or smuggle another header.
 */

/** Header names, configurable through `plugins.entries.<id>.config.headers`. */
export interface HeaderNames {
  sessionId: string;
  turnType: string;
  turnId: string;
  turnTrigger: string;
  userId: string;
}

/** The resolved plugin configuration. */
export interface ClawbridgeConfig {
  providerId: string;
  headers: HeaderNames;
  maxTrackedSessions: number;
  /** Send the agent id as the user header (`agentAsUser`; off by default). */
  agentAsUser: boolean;
}

/** What the agent hooks told us about the latest run of one session. */
export interface SessionFacts {
  sessionKey?: string;
  agentId?: string;
  runId?: string;
  trigger?: string;
  provenanceKind?: string;
}

export type TurnType = "main" | "side";

export const DEFAULT_PROVIDER_ID = "clawbridge";
export const DEFAULT_HEADERS: Readonly<HeaderNames> = Object.freeze({
  sessionId: "X-Session-Id",
  turnType: "X-Turn-Type",
  turnId: "X-Turn-Id",
  turnTrigger: "X-Turn-Trigger",
  userId: "X-User-Id",
});
export const DEFAULT_MAX_TRACKED_SESSIONS = 1024;

/** Triggers that mean a person asked for this turn. */
const USER_TRIGGERS = new Set(["user", "manual"]);
/** Input provenance kinds that mean the input did not come from an external user. */
const NON_USER_PROVENANCE = new Set(["inter_session", "internal_system"]);
/** RFC 9110 token: what a header name may be. */
const HEADER_TOKEN = /^[A-Za-z0-9!#$%&'*+.^_`|~-]+$/;
const PROVIDER_ID = /^[a-z0-9][a-z0-9._-]*$/;

// Minimal structural types for the parts of OpenClaw's plugin API this plugin uses. They mirror
// `ProviderPlugin`, `ProviderWrapStreamFnContext`, `ProviderResolveTransportTurnStateContext` and
// `PluginHookAgentContext` in openclaw/dist/plugin-sdk (checked against 2026.9.6).

/** Options OpenClaw passes to a stream function (subset of `SimpleStreamOptions`). */
export interface StreamOptions {
  sessionId?: string;
  requestId?: string;
  headers?: Record<string, string>;
  [key: string]: unknown;
}
export type StreamFn = (model: unknown, context: unknown, options?: StreamOptions) => unknown;

export interface WrapStreamFnContext {
  provider?: string;
  modelId?: string;
  streamFn?: StreamFn;
  [key: string]: unknown;
}

export interface TransportTurnStateContext {
  provider?: string;
  modelId?: string;
  sessionId?: string;
  turnId: string;
  attempt: number;
  transport: "stream" | "websocket";
}

export interface TransportTurnState {
  headers?: Record<string, string>;
}

export interface HookAgentContext {
  runId?: string;
  sessionKey?: string;
  sessionId?: string;
  trigger?: string;
  inputProvenance?: { kind?: string };
  [key: string]: unknown;
}

export interface ProviderDefinition {
  id: string;
  label: string;
  auth: unknown[];
  wrapStreamFn: (ctx: WrapStreamFnContext) => StreamFn | undefined;
  wrapSimpleCompletionStreamFn: (ctx: WrapStreamFnContext) => StreamFn | undefined;
  resolveTransportTurnState: (ctx: TransportTurnStateContext) => TransportTurnState | undefined;
}

export interface PluginApi {
  pluginConfig?: Record<string, unknown>;
  logger?: { debug?: (message: string) => void; warn: (message: string) => void };
  registerProvider: (provider: ProviderDefinition) => void;
  on: (hookName: string, handler: (event: unknown, ctx: HookAgentContext) => unknown) => void;
}

declare const crypto: { randomUUID(): string };

function asRecord(value: unknown): Record<string, unknown> {
  return value !== null && typeof value === "object" && !Array.isArray(value)
    ? (value as Record<string, unknown>)
    : {};
}

function nonEmptyString(value: unknown): string | undefined {
  return typeof value === "string" && value.trim() !== "" ? value.trim() : undefined;
}

/**
 * Resolve the plugin config, falling back to defaults for anything missing or malformed
 * (a bad header name would make every request fail, so it is never used).
 */
export function resolveConfig(raw: unknown, warn: (message: string) => void = () => {}): ClawbridgeConfig {
  const cfg = asRecord(raw);
  const headersRaw = asRecord(cfg.headers);
  const headers: HeaderNames = { ...DEFAULT_HEADERS };
  for (const key of Object.keys(DEFAULT_HEADERS) as (keyof HeaderNames)[]) {
    const value = headersRaw[key];
    if (value === undefined) continue;
    if (typeof value === "string" && HEADER_TOKEN.test(value)) headers[key] = value;
    else warn(`clawbridge: ignoring invalid header name for ${key}: ${JSON.stringify(value)}`);
  }
  const names = Object.values(headers).map((name) => name.toLowerCase());
  if (new Set(names).size !== names.length) {
    warn("clawbridge: configured header names collide; using the defaults");
    Object.assign(headers, DEFAULT_HEADERS);
  }
  let providerId = DEFAULT_PROVIDER_ID;
  const providerRaw = nonEmptyString(cfg.providerId);
  if (providerRaw !== undefined) {
    if (PROVIDER_ID.test(providerRaw)) providerId = providerRaw;
    else warn(`clawbridge: ignoring invalid providerId ${JSON.stringify(providerRaw)}`);
  }
  let maxTrackedSessions = DEFAULT_MAX_TRACKED_SESSIONS;
  const maxRaw = cfg.maxTrackedSessions;
  if (typeof maxRaw === "number" && Number.isInteger(maxRaw) && maxRaw > 0) maxTrackedSessions = maxRaw;
  const agentAsUser = cfg.agentAsUser === true;
  if (cfg.agentAsUser !== undefined && typeof cfg.agentAsUser !== "boolean") {
    warn(`clawbridge: ignoring non-boolean agentAsUser ${JSON.stringify(cfg.agentAsUser)}`);
  }
  return { providerId, headers, maxTrackedSessions, agentAsUser };
}

/** The agent a run belongs to: the hook's `agentId`, else the `<id>` of an `agent:<id>:...` session key. */
export function agentIdOf(agentId: string | undefined, sessionKey: string | undefined): string | undefined {
  if (agentId !== undefined) return agentId;
  const parts = sessionKey?.split(":");
  return parts !== undefined && parts.length >= 3 && parts[0] === "agent" && parts[1] !== "" ? parts[1] : undefined;
}

/** `main` only for a user/manual trigger whose input did not come from another session or the system. */
export function classifyTurn(facts: SessionFacts | undefined): TurnType {
  if (!facts?.trigger || !USER_TRIGGERS.has(facts.trigger)) return "side";
  if (facts.provenanceKind !== undefined && NON_USER_PROVENANCE.has(facts.provenanceKind)) return "side";
  return "main";
}

/** Make a value safe for an HTTP header: printable ASCII kept, anything else percent-encoded. */
export function headerValue(value: string): string {
  let out = "";
  for (const ch of value) {
    const code = ch.codePointAt(0) ?? 0;
    out += code >= 0x20 && code < 0x7f && ch !== "%" ? ch : encodeURIComponent(ch);
  }
  return out;
}

/** Bounded map from OpenClaw session id to the facts of its latest run (oldest evicted first). */
export class SessionFactsMap {
  private readonly entries = new Map<string, SessionFacts>();

  constructor(private readonly capacity: number) {}

  get size(): number {
    return this.entries.size;
  }

  get(sessionId: string | undefined): SessionFacts | undefined {
    return sessionId === undefined ? undefined : this.entries.get(sessionId);
  }

  /**
   * Merge what a hook saw into the session's facts. A hook of a different run (by `runId`)
   * starts fresh facts, keeping only the session key, which belongs to the session.
   */
  record(ctx: HookAgentContext | undefined, eventSessionId?: string): void {
    const sessionId = nonEmptyString(ctx?.sessionId) ?? nonEmptyString(eventSessionId);
    if (sessionId === undefined || ctx === undefined) return;
    const previous = this.entries.get(sessionId);
    const runId = nonEmptyString(ctx.runId);
    const sameRun = runId === undefined || previous?.runId === undefined || previous.runId === runId;
    const next: SessionFacts = sameRun
      ? { ...previous }
      : { sessionKey: previous?.sessionKey, agentId: previous?.agentId };
    if (next.sessionKey === undefined) delete next.sessionKey;
    if (next.agentId === undefined) delete next.agentId;
    const sessionKey = nonEmptyString(ctx.sessionKey);
    const agentId = nonEmptyString(ctx.agentId);
    const trigger = nonEmptyString(ctx.trigger);
    const provenanceKind = nonEmptyString(ctx.inputProvenance?.kind);
    if (sessionKey !== undefined) next.sessionKey = sessionKey;
    if (agentId !== undefined) next.agentId = agentId;
    if (runId !== undefined) next.runId = runId;
    if (trigger !== undefined) next.trigger = trigger;
    if (provenanceKind !== undefined) next.provenanceKind = provenanceKind;
    this.entries.delete(sessionId);
    this.entries.set(sessionId, next);
    while (this.entries.size > this.capacity) {
      const oldest = this.entries.keys().next().value;
      if (oldest === undefined) break;
      this.entries.delete(oldest);
    }
  }
}

/**
 * The headers for one model request. `forceSide` marks calls made outside an agent run;
 * `agentAsUser` adds the agent id as the user header when the agent is known.
 */
export function buildHeaders(
  names: HeaderNames,
  facts: SessionFacts | undefined,
  turnId: string,
  forceSide = false,
  agentAsUser = false,
): Record<string, string> {
  const headers: Record<string, string> = {};
  if (facts?.sessionKey !== undefined) headers[names.sessionId] = headerValue(facts.sessionKey);
  const agent = agentAsUser ? agentIdOf(facts?.agentId, facts?.sessionKey) : undefined;
  if (agent !== undefined) headers[names.userId] = headerValue(agent);
  headers[names.turnType] = forceSide ? "side" : classifyTurn(facts);
  headers[names.turnId] = headerValue(turnId);
  headers[names.turnTrigger] = headerValue(forceSide ? "completion" : (facts?.trigger ?? "unknown"));
  return headers;
}

/** Drop any header whose name matches one of ours (case-insensitively), then add ours. */
function mergeHeaders(
  existing: Record<string, string> | undefined,
  ours: Record<string, string>,
): Record<string, string> {
  const ourNames = new Set(Object.keys(ours).map((name) => name.toLowerCase()));
  const merged: Record<string, string> = {};
  for (const [name, value] of Object.entries(existing ?? {})) {
    if (!ourNames.has(name.toLowerCase())) merged[name] = value;
  }
  return { ...merged, ...ours };
}

/** Hooks whose context carries the session key, trigger and input provenance of a run. */
export const TRACKED_HOOKS = ["before_model_resolve", "before_agent_run", "llm_input", "model_call_started"] as const;

/** Register the provider and the hooks. Returns the session map (for tests and diagnostics). */
export function register(api: PluginApi): SessionFactsMap {
  const warn = (message: string): void => api.logger?.warn(message);
  const debug = (message: string): void => api.logger?.debug?.(message);
  const config = resolveConfig(api.pluginConfig, warn);
  const sessions = new SessionFactsMap(config.maxTrackedSessions);

  for (const hookName of TRACKED_HOOKS) {
    api.on(hookName, (event, ctx) => {
      sessions.record(ctx, nonEmptyString(asRecord(event).sessionId));
      return undefined;
    });
  }

  const wrap =
    (forceSide: boolean) =>
    (ctx: WrapStreamFnContext): StreamFn | undefined => {
      const inner = ctx.streamFn;
      if (typeof inner !== "function") return undefined;
      return (model, context, options) => {
        const facts = sessions.get(nonEmptyString(options?.sessionId));
        const turnId = nonEmptyString(options?.requestId) ?? crypto.randomUUID();
        const ours = buildHeaders(config.headers, facts, turnId, forceSide, config.agentAsUser);
        debug(`clawbridge: session ${options?.sessionId ?? "?"} headers ${JSON.stringify(ours)}`);
        return inner(model, context, { ...options, headers: mergeHeaders(options?.headers, ours) });
      };
    };

  api.registerProvider({
    id: config.providerId,
    label: "clawbridge",
    auth: [],
    wrapStreamFn: wrap(false),
    wrapSimpleCompletionStreamFn: wrap(true),
    // Transports that do not go through a wrapped stream function still get the headers;
    // where both apply, the stream options' headers (set above) win over these.
    resolveTransportTurnState: (ctx) => ({
      headers: buildHeaders(config.headers, sessions.get(nonEmptyString(ctx.sessionId)), ctx.turnId, false,
        config.agentAsUser),
    }),
  });
  return sessions;
}

/** The plugin entry OpenClaw loads (`openclaw.extensions` in package.json). */
const plugin = {
  id: "clawbridge",
  name: "clawbridge",
  description: "Tags model calls with their OpenClaw session and turn type for clawbridge.",
  register(api: PluginApi): void {
    register(api);
  },
};

export default plugin;
