// Early exit against full depth: ROUGE-L F1 on whitespace words (the same definition as
// eeserve.tuning.quality.rouge_l) and the side-by-side panel with the speeds measured here.

export function rougeL(candidate, reference) {
  const c = candidate.split(/\s+/).filter(Boolean);
  const r = reference.split(/\s+/).filter(Boolean);
  if (!c.length || !r.length) return c.length === r.length ? 1 : 0;
  const lcs = lcsLength(c, r);
  if (lcs === 0) return 0;
  const p = lcs / c.length;
  const rec = lcs / r.length;
  return (2 * p * rec) / (p + rec);
}

function lcsLength(a, b) {
  let prev = new Array(b.length + 1).fill(0);
  for (let i = 1; i <= a.length; i++) {
    const cur = new Array(b.length + 1).fill(0);
    for (let j = 1; j <= b.length; j++) {
      cur[j] = a[i - 1] === b[j - 1] ? prev[j - 1] + 1 : Math.max(prev[j], cur[j - 1]);
    }
    prev = cur;
  }
  return prev[b.length];
}

export function speedLine(result) {
  const parts = [`${result.tokens} tokens in ${result.seconds.toFixed(2)} s`];
  parts.push(`first after ${result.firstToken.toFixed(2)} s`);
  parts.push(`${result.tokensPerSecond.toFixed(1)} tokens/s after it`);
  if (result.stats) parts.push(`mean exit layer ${result.stats.mean_exit_layer.toFixed(1)}`);
  return parts.join(" · ");
}

function side(title, result, bodyNode) {
  const div = document.createElement("div");
  div.className = "side";
  const h = document.createElement("h3");
  h.textContent = title;
  const body = document.createElement("div");
  body.className = "body";
  body.append(bodyNode);
  const stats = document.createElement("small");
  stats.className = "speed";
  stats.textContent = result ? speedLine(result) : "running…";
  div.append(h, body, stats);
  return { div, body, stats };
}

// Builds the panel: the early-exit answer (its coloured spans) beside a full-depth body that the
// caller streams into; `finish(full)` writes speeds and ROUGE-L once full depth is done.
export function showComparison(el, early) {
  el.hidden = false;
  el.replaceChildren();
  const left = side("Early exit", early, early.node.cloneNode(true));
  const right = side("Full depth", null, document.createTextNode(""));
  const summary = document.createElement("p");
  summary.className = "summary";
  summary.id = "comparison-summary";
  el.append(left.div, right.div, summary);
  return {
    target: right.body,
    finish(full) {
      right.stats.textContent = speedLine(full);
      const rouge = rougeL(early.text, full.text);
      const speedup = early.tokensPerSecond / full.tokensPerSecond;
      summary.dataset.rougeL = rouge.toFixed(4);
      summary.textContent =
        `ROUGE-L (early exit vs full depth): ${rouge.toFixed(3)} · ` +
        `decode speed ratio ${speedup.toFixed(2)}× (tokens/s measured in this page)`;
    },
  };
}
