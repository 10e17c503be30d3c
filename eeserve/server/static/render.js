// Tokens coloured by exit layer: the palette, the legend, token spans and their hover details.
// Earlier exits get warmer tints; full depth stays plain; tokens a structured output's grammar
// forced (no layer chose them) are grey and underlined. Text stays dark on every tint.

export const FORCED_COLOR = "hsl(0, 0%, 86%)";

export function makePalette(exitConfig) {
  const numLayers = exitConfig.num_layers;
  const layers = [...exitConfig.exit_layers].sort((a, b) => a - b);
  const hueOf = (layer) => {
    const i = layers.indexOf(layer);
    const t = i >= 0 ? i / Math.max(layers.length - 1, 1) : layer / numLayers;
    return Math.round(20 + 250 * t);
  };
  return {
    numLayers,
    layers,
    color(layer) {
      if (layer >= numLayers) return null;
      return `hsl(${hueOf(layer)}, 85%, 80%)`;
    },
  };
}

export function renderLegend(el, palette) {
  el.replaceChildren();
  const title = document.createElement("strong");
  title.textContent = "exit layer:";
  el.append(title);
  for (const layer of palette.layers) {
    const s = document.createElement("span");
    s.textContent = String(layer);
    s.style.background = palette.color(layer);
    s.dataset.layer = String(layer);
    el.append(s);
  }
  const full = document.createElement("span");
  full.textContent = `${palette.numLayers} (full depth)`;
  el.append(full);
  const forced = document.createElement("span");
  forced.textContent = "forced by the grammar";
  forced.className = "forced";
  forced.style.background = FORCED_COLOR;
  el.append(forced);
}

// Hover text of one `exit_tokens` entry; shows speculative-decoding fields when the server
// sends them (a `draft` object, or flags beside the usual keys) without depending on them.
export function tokenInfo(entry, numLayers) {
  const lines = [];
  if (entry.forced) lines.push("forced by the grammar (no layer chose it)");
  else if (entry.exit_layer >= numLayers) lines.push(`full depth (layer ${numLayers})`);
  else lines.push(`exit layer ${entry.exit_layer} of ${numLayers}`);
  if (entry.confidence !== null && entry.confidence !== undefined) {
    lines.push(`confidence ${Number(entry.confidence).toFixed(3)}`);
  }
  for (const [key, value] of Object.entries(entry)) {
    if (["text", "exit_layer", "confidence", "forced"].includes(key)) continue;
    if (value && typeof value === "object") {
      for (const [k, v] of Object.entries(value)) lines.push(`${key} ${k}: ${fmt(v)}`);
    } else {
      lines.push(`${key}: ${fmt(value)}`);
    }
  }
  return lines.join("\n");
}

function fmt(v) {
  return typeof v === "number" && !Number.isInteger(v) ? v.toFixed(3) : String(v);
}

export function tokenSpan(entry, palette) {
  const s = document.createElement("span");
  s.className = "tok";
  s.textContent = entry.text;
  s.dataset.layer = String(entry.exit_layer);
  if (entry.confidence !== null && entry.confidence !== undefined) {
    s.dataset.confidence = String(entry.confidence);
  }
  s.dataset.info = tokenInfo(entry, palette.numLayers);
  if (entry.forced) {
    s.dataset.forced = "true";
    s.classList.add("forced");
    s.style.background = FORCED_COLOR;
    return s;
  }
  const color = palette.color(entry.exit_layer);
  if (color) s.style.background = color;
  return s;
}

export function attachTooltip(container, tip) {
  const show = (target) => {
    const tok = target.closest && target.closest(".tok");
    if (!tok || !container.contains(tok)) return;
    tip.textContent = tok.dataset.info;
    tip.hidden = false;
    const r = tok.getBoundingClientRect();
    tip.style.left = `${Math.max(4, Math.min(r.left, window.innerWidth - 260))}px`;
    tip.style.top = `${r.bottom + 6}px`;
  };
  container.addEventListener("mouseover", (e) => show(e.target));
  container.addEventListener("focusin", (e) => show(e.target));
  container.addEventListener("mouseout", () => (tip.hidden = true));
  container.addEventListener("focusout", () => (tip.hidden = true));
}
