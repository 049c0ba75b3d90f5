// The module's shape, its settings, and which providers the config hook wraps.
// No network here: wrapper behaviour is in wrapper.test.mjs.

import { test, after } from "node:test";
import assert from "node:assert/strict";
import { copyFileSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

import * as plugin from "../ocpc-plugin.js";

const PLUGIN_FILE = new URL("../ocpc-plugin.js", import.meta.url);
const WRAPPED = Symbol.for("oc-prefix-cache.wrapped-fetch");

const TMP = mkdtempSync(join(tmpdir(), "ocpc-plugin-test-"));
after(() => rmSync(TMP, { recursive: true, force: true }));

function provider(baseURL, extra = {}) {
  return { npm: "@ai-sdk/openai-compatible", options: { baseURL, apiKey: "sk-local", ...extra } };
}

async function configure(cfg, settings = {}) {
  const hooks = await plugin.OcPrefixCache({ directory: "/tmp", __ocpcSettings: settings });
  await hooks.config(cfg);
  return cfg;
}

function isWrapped(p) {
  return typeof p?.options?.fetch === "function" && p.options.fetch[WRAPPED] === true;
}

// Run fn with some environment variables set, then put them back.
async function withEnv(vars, fn) {
  const saved = Object.fromEntries(Object.keys(vars).map((k) => [k, process.env[k]]));
  Object.assign(process.env, vars);
  try {
    return await fn();
  } finally {
    for (const [k, v] of Object.entries(saved)) {
      if (v === undefined) delete process.env[k];
      else process.env[k] = v;
    }
  }
}

test("every export is a plugin function (OpenCode rejects anything else)", async () => {
  const exports = Object.entries(plugin);
  assert.deepEqual(exports.map(([name]) => name), ["OcPrefixCache"]);
  for (const [name, value] of exports) {
    assert.equal(typeof value, "function", `${name} must be a function`);
  }
  const hooks = await plugin.OcPrefixCache({ directory: "/tmp", __ocpcSettings: {} });
  assert.equal(typeof hooks.config, "function");
});

test("providers whose baseURL is the configured server are wrapped, others are not", async () => {
  const cfg = {
    provider: {
      withV1: provider("http://127.0.0.1:8080/v1"),
      trailingSlash: provider("http://127.0.0.1:8080/v1/"),
      bare: provider("http://127.0.0.1:8080"),
      bareSlash: provider("http://127.0.0.1:8080//"),
      localhost: provider("http://localhost:8080/v1"),
      upperCase: provider("HTTP://LOCALHOST:8080/V1"),
      otherPort: provider("http://127.0.0.1:8081/v1"),
      otherHost: provider("https://api.example.com/v1"),
      otherPath: provider("http://127.0.0.1:8080/proxy/v1"),
      noBaseURL: { options: { apiKey: "x" } },
      noOptions: { npm: "@ai-sdk/anthropic" },
      nothing: null,
    },
  };
  await configure(cfg, { baseURL: "http://127.0.0.1:8080" });
  const wrapped = Object.entries(cfg.provider).filter(([, p]) => isWrapped(p)).map(([id]) => id);
  assert.deepEqual(wrapped.sort(), ["bare", "bareSlash", "localhost", "trailingSlash", "upperCase", "withV1"].sort());
  // Everything else is left exactly as it was.
  assert.equal(cfg.provider.otherPort.options.fetch, undefined);
  assert.deepEqual(cfg.provider.noOptions, { npm: "@ai-sdk/anthropic" });
  assert.equal(cfg.provider.nothing, null);
});

test("a settings baseURL with localhost and /v1/ matches a 127.0.0.1 provider", async () => {
  const cfg = { provider: { llamacpp: provider("http://127.0.0.1:8080/v1") } };
  await configure(cfg, { baseURL: "http://localhost:8080/v1/" });
  assert.ok(isWrapped(cfg.provider.llamacpp));
});

test("never wraps twice, even across two plugin instances", async () => {
  const cfg = { provider: { llamacpp: provider("http://127.0.0.1:8080/v1") } };
  await configure(cfg);
  const first = cfg.provider.llamacpp.options.fetch;
  await configure(cfg);
  assert.equal(cfg.provider.llamacpp.options.fetch, first);
});

test("an existing provider fetch is kept as the one that forwards", async () => {
  const seen = [];
  const custom = async (url, init) => {
    seen.push([url, init]);
    return new Response("ok");
  };
  const cfg = { provider: { llamacpp: provider("http://127.0.0.1:8080/v1", { fetch: custom }) } };
  await configure(cfg);
  const wrapper = cfg.provider.llamacpp.options.fetch;
  assert.notEqual(wrapper, custom);
  const init = { method: "GET" };
  const res = await wrapper("http://127.0.0.1:8080/v1/models", init);
  assert.equal(await res.text(), "ok");
  assert.equal(seen.length, 1);
  assert.equal(seen[0][0], "http://127.0.0.1:8080/v1/models");
  assert.equal(seen[0][1], init, "the very same init object is passed on");
});

test("the config hook never throws", async () => {
  const hooks = await plugin.OcPrefixCache({ directory: "/tmp", __ocpcSettings: {} });
  await hooks.config(undefined);
  await hooks.config(null);
  await hooks.config({});
  await hooks.config({ provider: null });
  await hooks.config({ provider: "nonsense" });
  await hooks.config({ provider: { a: { options: { baseURL: 42 } } } });
  const hostile = {};
  Object.defineProperty(hostile, "provider", {
    get() {
      throw new Error("boom");
    },
  });
  await hooks.config(hostile);
});

test("the plugin function copes with no input at all", async () => {
  const hooks = await plugin.OcPrefixCache(undefined);
  assert.equal(typeof hooks.config, "function");
});

test("settings come from $OCPC_PLUGIN_CONFIG when no test settings are given", async () => {
  const dir = mkdtempSync(join(TMP, "case-"));
  const file = join(dir, "settings.json");
  writeFileSync(file, JSON.stringify({ baseURL: "http://127.0.0.1:9999" }));
  const cfg = {
    provider: { mine: provider("http://127.0.0.1:9999/v1"), defaultPort: provider("http://127.0.0.1:8080/v1") },
  };
  await withEnv({ OCPC_PLUGIN_CONFIG: file, OC_PREFIX_CACHE_BASE_URL: "" }, async () => {
    const hooks = await plugin.OcPrefixCache({ directory: "/tmp" });
    await hooks.config(cfg);
  });
  assert.ok(isWrapped(cfg.provider.mine));
  assert.ok(!isWrapped(cfg.provider.defaultPort));
});

test("env defaults apply when no settings file exists", async () => {
  const cfg = { provider: { mine: provider("http://127.0.0.1:7777/v1") } };
  await withEnv({ OCPC_PLUGIN_CONFIG: "", OC_PREFIX_CACHE_BASE_URL: "http://127.0.0.1:7777" }, async () => {
    const hooks = await plugin.OcPrefixCache({ directory: "/tmp" });
    await hooks.config(cfg);
  });
  assert.ok(isWrapped(cfg.provider.mine));
});

test("a broken $OCPC_PLUGIN_CONFIG falls back to defaults and is logged", async () => {
  const dir = mkdtempSync(join(TMP, "case-"));
  const file = join(dir, "settings.json");
  const log = join(dir, "plugin.jsonl");
  writeFileSync(file, "{not json");
  const cfg = { provider: { llamacpp: provider("http://127.0.0.1:8080/v1") } };
  await withEnv({ OCPC_PLUGIN_CONFIG: file, OC_PREFIX_CACHE_BASE_URL: "", OCPC_PLUGIN_LOG: log }, async () => {
    const hooks = await plugin.OcPrefixCache({ directory: "/tmp" });
    await hooks.config(cfg);
  });
  assert.ok(isWrapped(cfg.provider.llamacpp));
  // Waits for the last line written, so the earlier ones are there too (appends are ordered).
  const lines = await waitForLines(log, (ls) => ls.some((l) => l.ev === "wrapped" && l.provider === "llamacpp"));
  assert.ok(lines.some((l) => l.ev === "error" && l.stage === "settings" && l.error.includes("not valid JSON")));
});

test("ocpc-plugin.json next to the plugin file is read", async () => {
  // A copy of the plugin in its own folder, as `ocpc install` lays it out.
  const dir = mkdtempSync(join(TMP, "case-"));
  copyFileSync(PLUGIN_FILE, join(dir, "ocpc-plugin.js"));
  writeFileSync(join(dir, "ocpc-plugin.json"), JSON.stringify({ baseURL: "http://localhost:6666/v1" }));
  const copy = await import(pathToFileURL(join(dir, "ocpc-plugin.js")).href);
  const cfg = { provider: { mine: provider("http://127.0.0.1:6666/v1"), other: provider("http://127.0.0.1:8080/v1") } };
  await withEnv({ OCPC_PLUGIN_CONFIG: "", OC_PREFIX_CACHE_BASE_URL: "" }, async () => {
    const hooks = await copy.OcPrefixCache({ directory: "/tmp" });
    await hooks.config(cfg);
  });
  assert.ok(isWrapped(cfg.provider.mine));
  assert.ok(!isWrapped(cfg.provider.other));
});

async function waitForLines(file, predicate, ms = 2000) {
  const end = Date.now() + ms;
  for (;;) {
    let lines = [];
    try {
      lines = readFileSync(file, "utf8").trim().split("\n").filter(Boolean).map((l) => JSON.parse(l));
    } catch {
      // not written yet
    }
    if (predicate(lines)) return lines;
    if (Date.now() > end) throw new Error(`log ${file} never matched; got ${JSON.stringify(lines)}`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

test("a plugin log over 5 MB is rotated when the plugin starts", async () => {
  const { existsSync } = await import("node:fs");
  const logFile = join(TMP, "rotate-plugin.jsonl");
  writeFileSync(logFile, "x".repeat(5 * 1024 * 1024 + 1));
  await plugin.OcPrefixCache({ directory: "/tmp", __ocpcSettings: { logFile } });
  for (let i = 0; i < 50 && !existsSync(`${logFile}.1`); i++) await new Promise((r) => setTimeout(r, 20));
  for (let i = 0; i < 50 && !existsSync(logFile); i++) await new Promise((r) => setTimeout(r, 20));
  assert.ok(existsSync(`${logFile}.1`), "the old log was kept as .1");
  assert.ok(readFileSync(logFile, "utf8").includes('"ev":"init"'), "a new log started");
});

test("the plugin log is created 0600 whatever the umask: its lines hold session ids", async () => {
  const { existsSync, statSync } = await import("node:fs");
  const logFile = join(TMP, "private-plugin.jsonl");
  const before = process.umask(0o022);
  try {
    await plugin.OcPrefixCache({ directory: "/tmp", __ocpcSettings: { logFile } });
    for (let i = 0; i < 50 && !existsSync(logFile); i++) await new Promise((r) => setTimeout(r, 20));
  } finally {
    process.umask(before);
  }
  assert.equal(statSync(logFile).mode & 0o777, 0o600);
});
