// The live panel: polls /metrics (Prometheus text), parses it here and shows throughput,
// queue, KV blocks, the exit-layer histogram and the fraction of layers saved.

import { getText } from "./api.js";

export function parsePrometheus(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{(.*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const lm of (m[3] ?? "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[lm[1]] = lm[2];
    samples.push({ name: m[1], labels, value: Number(m[4]) });
  }
  return samples;
}

function one(samples, name) {
  const s = samples.find((x) => x.name === name);
  return s ? s.value : NaN;
}

// Cumulative `le` buckets -> per-layer counts (bucket le="l" holds tokens with exit layer <= l).
export function exitHistogram(samples) {
  const buckets = samples
    .filter((s) => s.name === "eeserve_exit_layer_bucket" && s.labels.le !== "+Inf")
    .map((s) => ({ layer: Number(s.labels.le), cum: s.value }))
    .sort((a, b) => a.layer - b.layer);
  let prev = 0;
  return buckets.map((b) => {
    const count = b.cum - prev;
    prev = b.cum;
    return { layer: b.layer, count };
  });
}

export function startMetrics({ getKey, values, histogram, status, palette, interval = 2000 }) {
  let last = null;
  const tick = async () => {
    try {
      const samples = parsePrometheus(await getText("/metrics", getKey()));
      const now = performance.now();
      const generated = one(samples, "eeserve_generation_tokens_total");
      let rate = 0;
      if (last) rate = (generated - last.generated) / ((now - last.at) / 1000);
      last = { at: now, generated };
      const saved = one(samples, "eeserve_layers_saved_total");
      const total = one(samples, "eeserve_layers_total");
      show(values, [
        ["tokens/s", rate.toFixed(1)],
        ["running", one(samples, "eeserve_num_requests_running")],
        ["waiting", one(samples, "eeserve_num_requests_waiting")],
        ["KV blocks used", one(samples, "eeserve_kv_blocks_used")],
        ["KV blocks free", one(samples, "eeserve_kv_blocks_free")],
        ["tokens generated", generated],
        ["layers saved", total > 0 ? `${((100 * saved) / total).toFixed(1)}%` : "–"],
      ]);
      drawHistogram(histogram, exitHistogram(samples), palette());
      status.textContent = "";
    } catch (e) {
      status.textContent = `(metrics: ${e.message})`;
    }
  };
  tick();
  return setInterval(tick, interval);
}

function show(dl, rows) {
  dl.replaceChildren();
  for (const [k, v] of rows) {
    const dt = document.createElement("dt");
    dt.textContent = k;
    const dd = document.createElement("dd");
    dd.textContent = String(v);
    dd.dataset.metric = k;
    dl.append(dt, dd);
  }
}

function drawHistogram(el, bins, palette) {
  el.replaceChildren();
  const used = bins.filter((b) => b.count > 0);
  const max = Math.max(1, ...used.map((b) => b.count));
  for (const b of used) {
    const row = document.createElement("div");
    row.className = "bar";
    row.dataset.layer = String(b.layer);
    const label = document.createElement("span");
    label.textContent = `layer ${b.layer}`;
    const fill = document.createElement("span");
    fill.className = "fill";
    fill.style.width = `${(8 * b.count) / max}rem`;
    fill.style.background = (palette && palette.color(b.layer)) || "#e4e7ec";
    const n = document.createElement("span");
    n.textContent = String(b.count);
    row.append(label, fill, n);
    el.append(row);
  }
  if (!used.length) el.textContent = "no tokens yet";
}
