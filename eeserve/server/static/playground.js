// The playground's wiring: loads the model name and exit config, builds each request body from
// the controls (shown under "Last request body"), runs the chat, the full-depth comparison and
// the metrics panel. Errors show the server's own message.

import { getJSON } from "./api.js";
import { runExchange } from "./chat.js";
import { showComparison } from "./compare.js";
import { startMetrics } from "./metrics.js";
import { attachTooltip, makePalette, renderLegend } from "./render.js";

const $ = (id) => document.getElementById(id);
const state = { model: null, exitConfig: null, palette: null, messages: [], last: null, busy: null };

function apiKey() {
  return $("api-key").value.trim();
}

function showError(message) {
  const el = $("error");
  el.textContent = message;
  el.hidden = !message;
}

async function loadServerInfo() {
  try {
    const models = await getJSON("/v1/models", apiKey());
    state.model = models.data[0].id;
    state.exitConfig = await getJSON("/v1/eeserve/exit_config", apiKey());
    state.palette = makePalette(state.exitConfig);
    $("model-name").textContent = `Model: ${state.model}, ${state.exitConfig.num_layers} layers.`;
    renderLegend($("legend"), state.palette);
    fillMeasures();
    showError("");
  } catch (e) {
    showError(e.status === 401 ? `${e.message} (enter the API key above)` : e.message);
  }
}

function fillMeasures() {
  const cfg = state.exitConfig;
  const sel = $("ee-measure");
  sel.replaceChildren(new Option(`model default (${cfg.default_measure})`, ""));
  for (const m of cfg.measures) sel.append(new Option(m, m));
  $("ee-enabled").checked = cfg.enabled_by_default;
  showDefault();
}

function showDefault() {
  const cfg = state.exitConfig;
  if (!cfg) return;
  const measure = $("ee-measure").value || cfg.default_measure;
  const el = $("ee-default");
  if ($("ee-criterion").value === "threshold") {
    const t = cfg.thresholds[measure];
    el.textContent = t === undefined ? `no default threshold for ${measure}` :
      `blank: the model's default for ${measure}, ${JSON.stringify(t)}`;
  } else {
    const cal = cfg.calibrated.filter((c) => c.measure === measure);
    el.textContent = cal.length ?
      "calibrated: " + cal.map((c) => `${c.tolerance} (threshold ${c.threshold})`).join(", ") :
      `no calibration for ${measure}: a tolerance will be refused`;
  }
}

// A number when the field holds one; otherwise the raw text, so the server names the problem.
function parseValue(raw) {
  const s = raw.trim();
  if (s === "") return undefined;
  const n = Number(s);
  return Number.isFinite(n) ? n : s;
}

// The schema box: parsed JSON when it holds some; its raw text otherwise, so the server names
// the problem (a 400 on response_format.json_schema.schema).
function jsonSchema(raw) {
  const s = raw.trim();
  if (s === "") return undefined;
  try {
    return JSON.parse(s);
  } catch {
    return s;
  }
}

export function buildBody(messages, fullDepth) {
  const body = { model: state.model, messages, stream: true, stream_options: { include_usage: true } };
  const maxTokens = parseValue($("max-tokens").value);
  if (maxTokens !== undefined) body.max_tokens = maxTokens;
  const temperature = parseValue($("temperature").value);
  if (temperature !== undefined) body.temperature = temperature;
  const ee = { enabled: fullDepth ? false : $("ee-enabled").checked };
  if (ee.enabled) {
    if ($("ee-measure").value) ee.measure = $("ee-measure").value;
    const v = parseValue($("ee-value").value);
    if (v !== undefined) ee[$("ee-criterion").value] = v;
  }
  body.early_exit = ee;
  const schema = jsonSchema($("json-schema").value);
  if (schema !== undefined) {
    body.response_format = { type: "json_schema", json_schema: { name: "output", schema, strict: true } };
  }
  $("last-request").textContent = JSON.stringify(body, null, 2);
  return body;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.textContent = text;
  $("messages").append(div);
  return div;
}

function setBusy(controller) {
  state.busy = controller;
  $("send").disabled = !!controller;
  $("stop").disabled = !controller;
  $("compare").disabled = !!controller || !state.last;
}

async function guarded(run) {
  if (state.busy) return;
  if (!state.model) await loadServerInfo();
  if (!state.model) return;
  const controller = new AbortController();
  setBusy(controller);
  showError("");
  try {
    await run(controller.signal);
  } catch (e) {
    if (e.name !== "AbortError") showError(e.message);
  } finally {
    setBusy(null);
  }
}

async function send() {
  const prompt = $("prompt").value;
  if (!prompt.trim()) return;
  await guarded(async (signal) => {
    const messages = [...state.messages, { role: "user", content: prompt }];
    const body = buildBody(messages, false);
    addMessage("user", prompt);
    $("prompt").value = "";
    const div = addMessage("assistant", "");
    const answer = document.createElement("span");
    div.append(answer);
    try {
      const result = await runExchange({ body, apiKey: apiKey(), palette: state.palette, target: answer, signal });
      const stats = document.createElement("small");
      stats.className = "stats";
      stats.textContent = statsLine(result);
      div.append(stats);
      state.messages = [...messages, { role: "assistant", content: result.text }];
      state.last = { ...result, messages, node: answer };
    } catch (e) {
      div.remove();
      $("messages").lastChild.remove();
      $("prompt").value = prompt;
      throw e;
    }
  });
}

function statsLine(r) {
  let s = `${r.tokens} tokens · ${r.tokensPerSecond.toFixed(1)} tokens/s`;
  if (r.stats) {
    s += ` · mean exit layer ${r.stats.mean_exit_layer.toFixed(1)} of ${r.stats.num_layers}`;
    s += ` · ${(100 * r.stats.layers_saved_fraction).toFixed(0)}% layers saved`;
  }
  return s;
}

async function compare() {
  const early = state.last;
  if (!early) return;
  await guarded(async (signal) => {
    const panel = showComparison($("comparison"), early);
    const body = buildBody(early.messages, true);
    const full = await runExchange({ body, apiKey: apiKey(), palette: state.palette, target: panel.target, signal });
    panel.finish(full);
  });
}

function init() {
  $("prompt-form").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey || !e.shiftKey) && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("compare").addEventListener("click", compare);
  $("stop").addEventListener("click", () => state.busy && state.busy.abort());
  $("clear").addEventListener("click", () => {
    state.messages = [];
    state.last = null;
    $("messages").replaceChildren();
    $("comparison").hidden = true;
    setBusy(null);
  });
  $("ee-measure").addEventListener("change", showDefault);
  $("ee-criterion").addEventListener("change", showDefault);
  $("api-key").addEventListener("change", loadServerInfo);
  attachTooltip($("messages"), $("tooltip"));
  attachTooltip($("comparison"), $("tooltip"));
  loadServerInfo();
  startMetrics({
    getKey: apiKey,
    values: $("metric-values"),
    histogram: $("histogram"),
    status: $("metrics-status"),
    palette: () => state.palette,
  });
}

init();
