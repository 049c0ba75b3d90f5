// The plugin's cost on the request path, measured side by side in one run, the arms
// alternating call by call:
// a direct fetch (no plugin) vs. the wrapped fetch with the daemon answering "hit",
// down (connection refused), and hung (accepts, never answers: bounded by
// headersTimeoutMs, 500 ms by default). The "server" is a local stub that answers at
// once, so what is measured is the wrapper alone.
//
//   node bench/failopen_bench.mjs [--calls 200] [--json FILE]
import http from "node:http";
import net from "node:net";
import { writeFileSync, readFileSync } from "node:fs";
import { OcPrefixCache } from "../plugin-js/ocpc-plugin.js";

const args = process.argv.slice(2);
const calls = Number(args[args.indexOf("--calls") + 1] || 0) || 200;
const jsonOut = args.includes("--json") ? args[args.indexOf("--json") + 1] : null;
const body = readFileSync(new URL("../tests/data/opencode-1.18.33/02_projA_turn1_main_request.json", import.meta.url), "utf8");

const listen = (server) => new Promise((r) => server.listen(0, "127.0.0.1", () => r(server.address().port)));

const llama = http.createServer((req, res) => {
  req.resume();
  req.on("end", () => {
    res.writeHead(200, { "content-type": "application/json" });
    res.end(JSON.stringify({ choices: [], timings: { cache_n: 7145, prompt_n: 354 } }));
  });
});
const daemon = http.createServer((req, res) => {
  req.resume();
  req.on("end", () => {
    res.writeHead(200, { "content-type": "application/json", "x-ocpc-state": "working" });
    res.end(JSON.stringify({ action: "hit", fingerprint: "0123456789abcdef", prefix_tokens: 7145, elapsed_ms: 0.2, reason: "" }));
  });
});
const held = [];
const hung = net.createServer((socket) => held.push(socket));
const llamaPort = await listen(llama);
const daemonPort = await listen(daemon);
const hungPort = await listen(hung);
const closed = net.createServer();
const downPort = await listen(closed);
await new Promise((r) => closed.close(r));

async function wrapped(daemonUrl) {
  const baseURL = `http://127.0.0.1:${llamaPort}`;
  const hooks = await OcPrefixCache({ directory: "/tmp", __ocpcSettings: { daemonUrl, baseURL, reportTimeoutMs: 200 } });
  const cfg = { provider: { local: { options: { baseURL: `${baseURL}/v1`, fetch: globalThis.fetch } } } };
  await hooks.config(cfg);
  return cfg.provider.local.options.fetch;
}

async function once(fetchFn) {
  const url = `http://127.0.0.1:${llamaPort}/v1/chat/completions`;
  const started = performance.now();
  const res = await fetchFn(url, { method: "POST", body, headers: { "content-type": "application/json", "user-agent": "opencode/1.18.33" } });
  await res.text();
  return performance.now() - started;
}

function stats(times) {
  const sorted = [...times].sort((a, b) => a - b);
  const n = sorted.length;
  return { calls: n, p50_ms: sorted[Math.floor(n / 2)], p99_ms: sorted[Math.min(n - 1, Math.floor(n * 0.99))] };
}

// A hung daemon costs the first request the headers bound (500 ms); the plugin then
// leaves it alone for hungBackoffMs (30 s), so the requests after it go straight on.
const hungFetch = await wrapped(`http://127.0.0.1:${hungPort}`);
const hungFirst = await once(hungFetch);
// The arms alternate call by call (direct, hit, down, hung, direct, ...), so load from
// other work on the machine lands on all of them alike; the loop ends well within the
// hung daemon's 30 s back-off.
const arms = {
  "direct (no plugin)": globalThis.fetch,
  "plugin, daemon answers hit": await wrapped(`http://127.0.0.1:${daemonPort}`),
  "plugin, daemon down": await wrapped(`http://127.0.0.1:${downPort}`),
  "plugin, daemon hung: next ones": hungFetch,
};
const times = Object.fromEntries(Object.keys(arms).map((name) => [name, []]));
for (let i = 0; i < calls; i++) {
  for (const [name, fetchFn] of Object.entries(arms)) times[name].push(await once(fetchFn));
}
const results = {};
for (const name of Object.keys(arms)) {
  if (name.startsWith("plugin, daemon hung")) results["plugin, daemon hung: 1st request"] = stats([hungFirst]);
  results[name] = stats(times[name]);
}
const base = results["direct (no plugin)"].p50_ms;
console.log("case".padEnd(34), "calls".padStart(6), "p50 ms".padStart(9), "p99 ms".padStart(9), "  p50 - direct");
for (const [name, r] of Object.entries(results)) {
  console.log(name.padEnd(34), String(r.calls).padStart(6), r.p50_ms.toFixed(2).padStart(9), r.p99_ms.toFixed(2).padStart(9), `  +${(r.p50_ms - base).toFixed(2)} ms`);
}
if (jsonOut) writeFileSync(jsonOut, JSON.stringify(results, null, 2));
for (const s of held) s.destroy();
for (const s of [llama, daemon, hung]) s.close();
process.exit(0);
