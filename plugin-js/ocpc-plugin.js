// oc-prefix-cache (ocpc) plugin for OpenCode.
//
// Before each chat request to the local llama-server, ask the ocpc daemon to prepare the
// server's slot (restore or warm the stable head of the prompt), then forward OpenCode's
// request byte-identical. After the answer, tell the daemon how many prompt tokens the
// server reused, so it can check that its preparation actually served the request.
//
// Fail-open is the rule: whatever goes wrong on the plugin's side (daemon down, hung,
// slow, broken answer), OpenCode's request goes out unchanged and nothing of ours is
// thrown into OpenCode.
//
// OpenCode treats every export of this module as a plugin function ("Plugin export is not
// a function" otherwise), so the module exports exactly one: OcPrefixCache. Helpers stay
// private; tests drive everything through the plugin function and `input.__ocpcSettings`.

import { readFileSync, promises as fsp } from "node:fs";

// Not exported (OpenCode would take it for a plugin function); `ocpc --version` and doctor
// read it from this file's text, and the init log line carries it.
const OCPC_PLUGIN_VERSION = "0.3.4";

// Shared across module copies (a global and a project plugin folder may both load this
// file), so a provider's fetch is never wrapped twice.
const WRAPPED = Symbol.for("oc-prefix-cache.wrapped-fetch");

// Request headers the daemon may see. An allow-list, so Authorization can never leak.
const FORWARDED_HEADERS = ["user-agent", "x-session-id", "x-session-affinity", "x-parent-session-id"];

// A non-stream JSON answer larger than this is not worth reading for two numbers.
const MAX_JSON_RESPONSE_CHARS = 8 * 1024 * 1024;

export const OcPrefixCache = async (input) => {
  const { settings, problem } = loadSettings(input);
  const log = makeLogger(settings.logFile);
  log({ ev: "init", version: OCPC_PLUGIN_VERSION, directory: safeString(input?.directory), daemonUrl: settings.daemonUrl, baseURL: settings.baseURL });
  if (problem) log({ ev: "error", stage: "settings", error: problem });
  return {
    config: async (cfg) => {
      try {
        wrapMatchingProviders(cfg, settings, log);
      } catch (err) {
        log({ ev: "error", stage: "config", error: describeError(err) });
      }
    },
  };
};

// ---------------------------------------------------------------------------------------
// Settings

function envDefaults() {
  const env = globalThis.process?.env ?? {};
  return {
    daemonUrl: env.OC_PREFIX_CACHE_DAEMON_URL || "http://127.0.0.1:8765",
    baseURL: env.OC_PREFIX_CACHE_BASE_URL || "http://127.0.0.1:8080",
    headersTimeoutMs: 500,
    // Under OpenCode's own provider timeout (300 s by default): a longer cold warm-up
    // gives up here, and the request goes on (and prefills the head itself).
    prepareTimeoutMs: 240000,
    reportTimeoutMs: 2000,
    hungBackoffMs: 30000,
    // On a server with several slots (-np N), send the request to the slot the daemon prepared
    // (an "id_slot" field added to the body; the prompt is unchanged). false: OpenCode's bytes
    // go out untouched and the server picks the slot.
    pinSlot: true,
    logFile: env.OCPC_PLUGIN_LOG || null,
  };
}

// Sources in order: test settings, $OCPC_PLUGIN_CONFIG, ocpc-plugin.json next to this file.
// Keys missing from the chosen source keep their env defaults.
function loadSettings(input) {
  const defaults = envDefaults();
  let given = {};
  let problem = null;
  if (input && typeof input.__ocpcSettings === "object" && input.__ocpcSettings !== null) {
    given = input.__ocpcSettings;
  } else {
    ({ given, problem } = readSettingsFile());
  }
  return { settings: cleanSettings(defaults, given), problem };
}

function readSettingsFile() {
  const fromEnv = globalThis.process?.env?.OCPC_PLUGIN_CONFIG;
  let target;
  try {
    target = fromEnv || new URL("./ocpc-plugin.json", import.meta.url);
  } catch {
    return { given: {}, problem: null }; // no file URL for this module: env defaults only
  }
  let text;
  try {
    text = readFileSync(target, "utf8");
  } catch (err) {
    // No file next to the plugin is normal (env defaults); a named file that is missing is not.
    const problem = fromEnv ? `cannot read OCPC_PLUGIN_CONFIG ${fromEnv}: ${describeError(err)}` : null;
    return { given: {}, problem };
  }
  try {
    const parsed = JSON.parse(text);
    if (parsed && typeof parsed === "object" && !Array.isArray(parsed)) return { given: parsed, problem: null };
    return { given: {}, problem: `settings file ${String(target)} is not a JSON object` };
  } catch (err) {
    return { given: {}, problem: `settings file ${String(target)} is not valid JSON: ${describeError(err)}` };
  }
}

// Bad values fall back to the default rather than failing: a typo must not break OpenCode.
function cleanSettings(defaults, given) {
  const text = (key) => (typeof given[key] === "string" && given[key].trim() ? given[key].trim() : defaults[key]);
  const millis = (key) => (Number.isFinite(given[key]) && given[key] > 0 ? given[key] : defaults[key]);
  let logFile = defaults.logFile;
  if (given.logFile === null || typeof given.logFile === "string") logFile = given.logFile || null;
  return {
    daemonUrl: text("daemonUrl").replace(/\/+$/, ""),
    baseURL: text("baseURL"),
    headersTimeoutMs: millis("headersTimeoutMs"),
    prepareTimeoutMs: millis("prepareTimeoutMs"),
    reportTimeoutMs: millis("reportTimeoutMs"),
    hungBackoffMs: millis("hungBackoffMs"),
    pinSlot: typeof given.pinSlot === "boolean" ? given.pinSlot : defaults.pinSlot,
    logFile,
  };
}

// ---------------------------------------------------------------------------------------
// Log: one JSON line per event, appended in order, never the body or Authorization.

// One old generation is kept: the log stays under about twice this size.
const MAX_LOG_BYTES = 5 * 1024 * 1024;

function makeLogger(file) {
  if (!file) return () => {};
  let chain = rotateIfLarge(file);
  return (event) => {
    let line;
    try {
      line = JSON.stringify({ t: Date.now(), ...event }) + "\n";
    } catch {
      return;
    }
    // Chained so lines keep their order; a failing disk only loses log lines. A new file is
    // 0600 whatever OpenCode's umask: its lines hold session ids (0.3.3).
    chain = chain.then(() => fsp.appendFile(file, line, { mode: 0o600 })).catch(() => {});
  };
}

// Checked when a plugin instance starts (each OpenCode start), not per line.
async function rotateIfLarge(file) {
  try {
    const { size } = await fsp.stat(file);
    if (size > MAX_LOG_BYTES) await fsp.rename(file, `${file}.1`);
  } catch {
    // no log yet, or it cannot be moved: keep appending
  }
}

// ---------------------------------------------------------------------------------------
// Provider matching (config hook)

function wrapMatchingProviders(cfg, settings, log) {
  const providers = cfg?.provider;
  if (!providers || typeof providers !== "object") return;
  const target = normaliseBaseURL(settings.baseURL);
  for (const [id, provider] of Object.entries(providers)) {
    const options = provider?.options;
    if (!options || typeof options !== "object") continue;
    if (normaliseBaseURL(options.baseURL) !== target) continue;
    if (options.fetch && options.fetch[WRAPPED]) continue;
    const previousFetch = typeof options.fetch === "function" ? options.fetch : defaultFetch;
    options.fetch = makeWrapper(previousFetch, settings, log);
    log({ ev: "wrapped", provider: id, baseURL: options.baseURL });
  }
}

// Looked up per call, not captured at load, so the runtime's fetch is always the one used.
function defaultFetch(url, init) {
  return globalThis.fetch(url, init);
}

// Same server <=> same normalised text: lower-case scheme and host (URL does that),
// localhost = 127.0.0.1, no trailing slashes, no trailing /v1 (OpenCode configs carry it,
// ocpc settings may not).
function normaliseBaseURL(value) {
  if (typeof value !== "string" || !value.trim()) return null;
  let text = value.trim();
  try {
    const url = new URL(text);
    const host = url.hostname === "localhost" ? "127.0.0.1" : url.hostname;
    text = `${url.protocol}//${host}${url.port ? ":" + url.port : ""}${url.pathname}`;
  } catch {
    text = text.toLowerCase();
  }
  text = text.replace(/\/+$/, "");
  if (text.toLowerCase().endsWith("/v1")) text = text.slice(0, -3);
  return text.replace(/\/+$/, "");
}

// ---------------------------------------------------------------------------------------
// The fetch wrapper

function makeWrapper(previousFetch, settings, log) {
  // A daemon that took a connection but did not answer in time (no headers within
  // headersTimeoutMs, or headers but no answer within prepareTimeoutMs) is hung: waiting
  // on every request would tax a whole session, so it is left alone for hungBackoffMs.
  const breaker = { pausedUntil: 0 };
  // This wrapper's reports not yet delivered: {ended, settled}. See observeUsage.
  const reports = new Set();
  const wrapper = async (url, init) => {
    const call = describeChatCall(url, init);
    if (!call) return previousFetch(url, init);

    let prepared = null;
    if (Date.now() < breaker.pausedUntil) {
      log({ ev: "error", stage: "prepare", skipped: true, error: "daemon was hung; not asked until it has had time to recover" });
    } else {
      // The daemon decides on this request knowing what the previous one reused.
      await waitForReports(reports, init?.signal, settings, log);
      prepared = await prepareQuietly(call, init, settings, log, breaker);
    }

    // The very same url and init objects: the body bytes OpenCode built go out untouched,
    // except, on a server with several slots, the slot the daemon prepared (pinSlot).
    const sent = pinned(init, prepared, settings);
    const started = Date.now();
    let response;
    try {
      response = await previousFetch(url, sent);
    } catch (err) {
      log({ ev: "forward", ms: Date.now() - started, error: describeError(err) });
      throw err; // OpenCode's own error (abort, connection refused...): not ours to hide
    }
    log({ ev: "forward", ms: Date.now() - started, status: response.status, ...(sent !== init ? { slot: prepared.slot } : {}) });
    try {
      return observeUsage(response, prepared, init, settings, log, reports);
    } catch (err) {
      // Only reachable before the tee (e.g. a custom fetch returned an odd object), so the
      // answer is still whole.
      log({ ev: "error", stage: "observe", error: describeError(err) });
      return response;
    }
  };
  wrapper[WRAPPED] = true;
  return wrapper;
}

// init with "id_slot" added as the body's first key when the daemon prepared a slot of a
// server with several (its answer says pin); else the very same init. A body that names a
// slot itself is left alone.
function pinned(init, prepared, settings) {
  if (!settings.pinSlot || !prepared?.pin || prepared.slot === null) return init;
  const body = init.body;
  const start = body.indexOf("{");
  if (start < 0 || /"id_slot"\s*:/.test(body)) return init;
  const rest = body.slice(start + 1).trimStart();
  const sep = rest.startsWith("}") ? "" : ",";
  return { ...init, body: `${body.slice(0, start + 1)}"id_slot":${prepared.slot}${sep}${body.slice(start + 1)}` };
}

// A chat completion with a string body -> {body, headers}; anything else -> null.
// Never throws: an odd argument just means "not ours", and the request passes through.
function describeChatCall(url, init) {
  try {
    const isRequest = typeof Request !== "undefined" && url instanceof Request;
    const method = String(init?.method ?? (isRequest ? url.method : "GET")).toUpperCase();
    if (method !== "POST" || typeof init?.body !== "string") return null;
    const href = typeof url === "string" ? url : url instanceof URL ? url.href : isRequest ? url.url : null;
    if (!href || !new URL(href).pathname.endsWith("/chat/completions")) return null;
    const headers = pickHeaders(init.headers ?? (isRequest ? url.headers : undefined));
    return { body: init.body, headers };
  } catch {
    return null;
  }
}

function pickHeaders(source) {
  const picked = {};
  for (const [name, value] of headerEntries(source)) {
    const key = String(name).toLowerCase();
    if (FORWARDED_HEADERS.includes(key) && value !== undefined && value !== null) picked[key] = String(value);
  }
  return picked;
}

// Headers instance, [name, value] pairs, or a plain object.
function headerEntries(source) {
  if (!source) return [];
  if (typeof source.entries === "function" && typeof source.get === "function") return [...source.entries()];
  if (Array.isArray(source)) return source;
  if (typeof source === "object") return Object.entries(source);
  return [];
}

// ---------------------------------------------------------------------------------------
// Prepare: ask the daemon, bounded, and turn every failure into "no answer" (null).

async function prepareQuietly(call, init, settings, log, breaker) {
  const started = Date.now();
  try {
    const { status, answer } = await askDaemon(call, init?.signal, settings);
    log({
      ev: "prepare",
      action: answer.action,
      ms: Date.now() - started,
      status,
      fingerprint: answer.fingerprint,
      prepare_id: answer.prepare_id ?? undefined,
      prefix_tokens: answer.prefix_tokens,
      daemon_ms: answer.elapsed_ms,
      reason: answer.reason,
      session: call.headers["x-session-id"],
    });
    return answer;
  } catch (err) {
    if (err?.hung) breaker.pausedUntil = Date.now() + settings.hungBackoffMs;
    const backoff = err?.hung ? { backoff_ms: settings.hungBackoffMs } : {};
    log({ ev: "error", stage: "prepare", ms: Date.now() - started, status: err?.status ?? null, error: describeError(err), ...backoff });
    return null;
  }
}

class DaemonError extends Error {
  constructor(message, status = null, hung = false) {
    super(message);
    this.name = "DaemonError";
    this.status = status;
    this.hung = hung;
  }
}

// Two bounds, because the daemon answers in two steps: headers at once ("working"), the
// JSON when the slot is ready. No headers within headersTimeoutMs means down or hung; a
// daemon that did answer is given up to prepareTimeoutMs in all, since a cold warm-up
// prefills the same tokens the real request would otherwise prefill itself. The daemon is
// told that budget (x-ocpc-budget-ms), so it stops changing the slot a margin before it:
// a slot change landing after we gave up would hit the request we then sent. Either bound
// firing marks the daemon hung (the breaker); OpenCode's own abort does not.
async function askDaemon(call, outerSignal, settings) {
  const controller = new AbortController();
  let why = null;
  const stop = (reason) => {
    if (why === null) why = reason;
    controller.abort();
  };
  let hung = false;
  const cancelHeadersTimer = patientTimeout(settings.headersTimeoutMs, () => {
    hung = true;
    stop(`no response headers within ${settings.headersTimeoutMs} ms`);
  });
  const totalTimer = setTimeout(() => {
    hung = true;
    stop(`no answer within ${settings.prepareTimeoutMs} ms`);
  }, settings.prepareTimeoutMs);
  // If OpenCode gives up on the request (user abort, its own timeout), stop waiting too.
  const onOuterAbort = () => stop("request aborted by OpenCode");
  // Raced against every await below, so the bounds hold even on a runtime whose fetch
  // would not end a body read when its signal aborts.
  const aborted = new Promise((resolve, reject) => {
    controller.signal.addEventListener("abort", () => reject(new DaemonError(why)), { once: true });
  });
  aborted.catch(() => {}); // handled through the races; never an unhandled rejection
  if (outerSignal?.aborted) onOuterAbort();
  outerSignal?.addEventListener?.("abort", onOuterAbort, { once: true });
  try {
    const request = globalThis.fetch(`${settings.daemonUrl}/v1/prepare`, {
      method: "POST",
      headers: {
        "content-type": "application/json", ...call.headers,
        "x-ocpc-budget-ms": String(Math.floor(settings.prepareTimeoutMs)),
        ...(settings.pinSlot ? { "x-ocpc-pin": "1" } : {}),
      },
      body: call.body,
      signal: controller.signal,
      timeout: false, // Bun's own fetch timeout would cut a long warm-up short; ours bound it
    });
    const response = await Promise.race([request, aborted]);
    cancelHeadersTimer();
    if (!response.ok) {
      response.body?.cancel().catch(() => {});
      throw new DaemonError(`daemon answered HTTP ${response.status}`, response.status);
    }
    const text = await Promise.race([response.text(), aborted]);
    return { status: response.status, answer: parseAnswer(text) };
  } catch (err) {
    if (why !== null) throw new DaemonError(why, null, hung);
    throw err;
  } finally {
    cancelHeadersTimer();
    clearTimeout(totalTimer);
    outerSignal?.removeEventListener?.("abort", onOuterAbort);
  }
}

// A bound of `ms` of the event loop's own time, not of the wall clock. Its timer ticks every STEP_MS
// and each tick counts what it was set for, not how late it ran: on a loaded machine (a compile
// beside OpenCode) every process runs late alike, the daemon answering as the plugin's own timers
// do, so the bound stretches with the load and a slow daemon is not taken for a hung one. Measured
// on 2 cores with 12 busy loops beside the tests (issue 36): the daemon's headers came 270-440 ms
// after the prepare was sent, against a 500 ms bound, while OpenCode's 25 ms timers ran 60-85 ms
// apart, or not at all for 2.5 s as it started; with 20, a prepare after a server restart had no
// headers at 500 ms, the plugin gave up on the working daemon, and that turn had no report.
// A tick later than STALL_MS (a stalled loop) never ends the bound: what arrived meanwhile (the
// daemon's headers, a report's answer) is still unread then, since expired timers run before the
// loop reads its sockets, so it looks again after the loop's next turn (0.3.2). Lateness stretches
// a bound by LATE_CREDIT_MS at most: a loop late all along still gives up. Returns the cancel
// function.
const STEP_MS = 25;
const STALL_MS = 50; // later than this: the loop was stalled, not just busy
const RECHECK_MS = 10;
const LATE_CREDIT_MS = 10000;
function patientTimeout(ms, onTimeout) {
  let handle = null;
  let counted = 0;
  const cap = Date.now() + ms + LATE_CREDIT_MS;
  const arm = (delay) => {
    const due = Date.now() + delay;
    handle = setTimeout(() => {
      const now = Date.now();
      counted += delay;
      if (now >= cap) onTimeout();
      else if (now - due > STALL_MS) arm(RECHECK_MS);
      else if (counted >= ms) onTimeout();
      else arm(Math.min(STEP_MS, ms - counted));
    }, delay);
  };
  arm(Math.min(STEP_MS, ms));
  return () => clearTimeout(handle);
}

function parseAnswer(text) {
  let data;
  try {
    data = JSON.parse(text);
  } catch {
    throw new DaemonError(`daemon answer is not JSON (${text.length} chars)`, 200);
  }
  if (!data || typeof data !== "object" || typeof data.action !== "string") {
    throw new DaemonError("daemon answer has no action", 200);
  }
  return {
    action: data.action,
    fingerprint: typeof data.fingerprint === "string" && data.fingerprint ? data.fingerprint : null,
    // Protocol v2: the daemon's id for this prepare, echoed in the report. Older daemons send none.
    prepare_id: typeof data.prepare_id === "string" && data.prepare_id ? data.prepare_id : null,
    prefix_tokens: Number.isFinite(data.prefix_tokens) ? data.prefix_tokens : null,
    elapsed_ms: Number.isFinite(data.elapsed_ms) ? data.elapsed_ms : null,
    reason: typeof data.reason === "string" ? data.reason : "",
    // Protocol v3: the slot prepared, and whether to send the request there (-np N).
    slot: Number.isInteger(data.slot) && data.slot >= 0 ? data.slot : null,
    pin: data.pin === true,
  };
}

// ---------------------------------------------------------------------------------------
// Report: read the server's reuse counts from a copy of the answer, in the background.

// The report is pending in `reports` from the tee until it is delivered (or given up).
// OpenCode's copy of the answer ends only once the report is delivered, at most
// reportTimeoutMs later: `opencode run` exits as soon as it has read the answer, and a
// report still in flight then was lost (the daemon never learned the turn). The wait is one
// loopback POST, and it is the wait the next prepare would make anyway (waitForReports,
// which still covers a report given up on). Another request's answer that is still
// streaming (a parallel session) is not waited for.
function observeUsage(response, prepared, init, settings, log, reports) {
  if (!prepared?.fingerprint || !canObserve(response)) return response;
  const fingerprint = prepared.fingerprint;
  const prepareId = prepared.prepare_id;
  const isJson = (response.headers.get("content-type") || "").toLowerCase().includes("application/json");
  // tee: OpenCode reads its branch at the server's pace; ours is read alongside it and
  // never holds OpenCode's branch back.
  const [forOpenCode, forUs] = response.body.tee();
  const entry = { ended: false, settled: null };
  const markEnded = new TransformStream({
    async flush() {
      entry.ended = true;
      await within(entry.settled, settings.reportTimeoutMs);
    },
  });
  const copy = new Response(forOpenCode.pipeThrough(markEnded), {
    status: response.status,
    statusText: response.statusText,
    headers: response.headers,
  });
  reports.add(entry);
  entry.settled = readCounts(forUs, isJson, init?.signal)
    .then((counts) => {
      entry.ended = true; // our copy ended: the report is on its way now
      if (!counts) {
        log({ ev: "report", fingerprint, sent: false, reason: "no timings or usage in the answer" });
        return;
      }
      return sendReport(fingerprint, prepareId, counts, settings, log);
    })
    .catch((err) => log({ ev: "error", stage: "report", error: describeError(err) }))
    .finally(() => reports.delete(entry));
  return copy;
}

// Before a prepare: wait for the reports of answers that have ended (normally one, being
// posted right now), at most reportTimeoutMs, and not past OpenCode aborting the request.
async function waitForReports(reports, signal, settings, log) {
  const pending = [...reports].filter((entry) => entry.ended).map((entry) => entry.settled);
  if (pending.length === 0) return;
  const started = Date.now();
  let timer = null;
  let onAbort = null;
  const bound = new Promise((resolve) => {
    timer = patientTimeout(settings.reportTimeoutMs, () => resolve("timeout"));
  });
  const aborted = new Promise((resolve) => {
    onAbort = () => resolve("aborted");
    if (signal?.aborted) onAbort();
    signal?.addEventListener?.("abort", onAbort, { once: true });
  });
  try {
    const outcome = await Promise.race([Promise.allSettled(pending).then(() => "settled"), bound, aborted]);
    log({ ev: "report_wait", ms: Date.now() - started, reports: pending.length, outcome });
  } finally {
    timer?.();
    signal?.removeEventListener?.("abort", onAbort);
  }
}

// Waits for `promise` (never rejects here) or `ms` of the event loop's running time
// (patientTimeout), whichever comes first.
async function within(promise, ms) {
  let cancel = null;
  const bound = new Promise((resolve) => {
    cancel = patientTimeout(ms, resolve);
  });
  try {
    await Promise.race([Promise.resolve(promise).catch(() => {}), bound]);
  } finally {
    cancel?.();
  }
}

// Only a 2xx answer that has a body can be copied into a new Response (204/205 cannot).
function canObserve(response) {
  return Boolean(response && response.ok && response.body && response.status !== 204 && response.status !== 205);
}

async function readCounts(stream, isJson, signal) {
  const reader = stream.getReader();
  // A tee'd source is only cancelled when both branches are: if OpenCode aborts, let go of
  // ours too, or the server would keep generating for nobody.
  const onAbort = () => reader.cancel().catch(() => {});
  if (signal?.aborted) onAbort();
  signal?.addEventListener?.("abort", onAbort, { once: true });
  try {
    return isJson ? await countsFromJson(reader) : await countsFromSse(reader);
  } finally {
    signal?.removeEventListener?.("abort", onAbort);
  }
}

// SSE: `data: {...}` lines. Only lines that mention timings or usage are parsed; the last
// timings seen win, usage is the fallback when no chunk carried timings.
async function countsFromSse(reader) {
  const decoder = new TextDecoder();
  let pending = "";
  let fromTimings = null;
  let fromUsage = null;
  const take = (line) => {
    const found = countsFromSseLine(line);
    if (found?.source === "timings") fromTimings = found;
    else if (found) fromUsage = found;
  };
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    pending += decoder.decode(value, { stream: true });
    const lines = pending.split("\n");
    pending = lines.pop();
    lines.forEach(take);
  }
  take(pending + decoder.decode());
  return fromTimings ?? fromUsage;
}

function countsFromSseLine(rawLine) {
  const line = rawLine.trim();
  if (!line.startsWith("data:")) return null;
  if (!line.includes('"timings"') && !line.includes('"usage"')) return null;
  try {
    return countsFromChunk(JSON.parse(line.slice(5)));
  } catch {
    return null;
  }
}

async function countsFromJson(reader) {
  const decoder = new TextDecoder();
  let text = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    text += decoder.decode(value, { stream: true });
    if (text.length > MAX_JSON_RESPONSE_CHARS) {
      await reader.cancel();
      return null;
    }
  }
  text += decoder.decode();
  try {
    return countsFromChunk(JSON.parse(text));
  } catch {
    return null;
  }
}

// llama-server: timings.{cache_n, prompt_n} (preferred), or the OpenAI-style usage, where
// cached_tokens are the reused ones and the rest were processed. Without cached_tokens the
// reuse is unknown: no report rather than a wrong "0 reused". The generated count
// (predicted_n) lets the daemon tie the slot's new contents to this request.
function countsFromChunk(chunk) {
  const timings = chunk?.timings;
  const usage = chunk?.usage;
  const generated = isCount(timings?.predicted_n) ? timings.predicted_n
    : isCount(usage?.completion_tokens) ? usage.completion_tokens : null;
  const withGenerated = (counts) => (generated === null ? counts : { ...counts, predicted_n: generated });
  if (isCount(timings?.cache_n) && isCount(timings?.prompt_n)) {
    const ms = Number.isFinite(timings.prompt_ms) && timings.prompt_ms >= 0 ? { prompt_ms: timings.prompt_ms } : {};
    return withGenerated({ cache_n: timings.cache_n, prompt_n: timings.prompt_n, ...ms, source: "timings" });
  }
  const cached = usage?.prompt_tokens_details?.cached_tokens;
  if (isCount(usage?.prompt_tokens) && isCount(cached) && cached <= usage.prompt_tokens) {
    return withGenerated({ cache_n: cached, prompt_n: usage.prompt_tokens - cached, source: "usage" });
  }
  return null;
}

function isCount(value) {
  return Number.isInteger(value) && value >= 0;
}

async function sendReport(fingerprint, prepareId, counts, settings, log) {
  const controller = new AbortController();
  // Patient: a stall as the report leaves must not abort it before it is even written.
  const cancelTimer = patientTimeout(settings.reportTimeoutMs, () => controller.abort());
  const payload = { fingerprint, cache_n: counts.cache_n, prompt_n: counts.prompt_n };
  if (counts.predicted_n !== undefined) payload.predicted_n = counts.predicted_n;
  if (counts.prompt_ms !== undefined) payload.prompt_ms = counts.prompt_ms;
  if (prepareId) payload.prepare_id = prepareId;
  try {
    const response = await globalThis.fetch(`${settings.daemonUrl}/v1/report`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify(payload),
      signal: controller.signal,
    });
    await response.text(); // drain, so the connection can be reused
    log({ ev: "report", ...payload, source: counts.source, sent: true, status: response.status });
  } catch (err) {
    log({ ev: "error", stage: "report", ...payload, error: describeError(err) });
  } finally {
    cancelTimer();
  }
}

// ---------------------------------------------------------------------------------------
// Small helpers

function describeError(err) {
  if (err instanceof Error) {
    const cause = err.cause instanceof Error ? `: ${err.cause.message}` : "";
    return `${err.name}: ${err.message}${cause}`;
  }
  return String(err);
}

function safeString(value) {
  return typeof value === "string" ? value : null;
}
