// Drive an OpenCode plugin file the way OpenCode 1.18 does, against a real daemon and a
// real llama-server: load it, run its config hook on a provider pointing at the server,
// then send each body through the provider's fetch and read the whole answer.
//
//   node drive_plugin.mjs PLUGIN_FILE DAEMON_URL SERVER_URL LOG_FILE BODY_FILE:SESSION...
//
// Prints one JSON line per request: {status, ms}. The plugin's own log says what it did.
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";

const [pluginFile, daemonUrl, serverUrl, logFile, ...turns] = process.argv.slice(2);
const { OcPrefixCache } = await import(pathToFileURL(pluginFile).href);
const hooks = await OcPrefixCache({ __ocpcSettings: { daemonUrl, baseURL: serverUrl, logFile } });
const cfg = { provider: { llamacpp: { options: { baseURL: `${serverUrl}/v1` } } } };
await hooks.config(cfg);
const fetchViaPlugin = cfg.provider.llamacpp.options.fetch;

for (const turn of turns) {
  const [file, session] = turn.split(":");
  const body = JSON.parse(readFileSync(file, "utf8"));
  body.max_tokens = 4;  // the tiny model never stops by itself
  const started = Date.now();
  const send = () => fetchViaPlugin(`${serverUrl}/v1/chat/completions`, {
    method: "POST",
    headers: {
      "content-type": "application/json",
      "user-agent": "opencode/1.18.33 ai-sdk/provider-utils/4.0.23 runtime/bun/1.3.14",
      "x-session-id": session,
      "x-session-affinity": session,
    },
    body: JSON.stringify(body),
  });
  let response;
  let retried = false;
  try {
    response = await send();
  } catch (err) {
    // A keep-alive connection the server closed just as it was reused (llama-server's idle
    // timeout is 5 s): OpenCode's AI SDK retries network errors, so does this driver.
    if (err?.cause?.code !== "UND_ERR_SOCKET") throw err;
    retried = true;
    response = await send();
  }
  await response.text();
  console.log(JSON.stringify({ status: response.status, ms: Date.now() - started, retried }));
}
await new Promise((resolve) => setTimeout(resolve, 500)); // the last report goes in the background
