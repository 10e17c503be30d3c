// One streamed exchange: sends the request, appends each token as a coloured span as it
// arrives, and measures the speed in the page (completion tokens / seconds from send to the
// last event). `content` deltas are the answer's text; `exit_tokens` (eeserve extension) say
// where each token left the model.

import { streamChat } from "./api.js";
import { tokenSpan } from "./render.js";

export async function runExchange({ body, apiKey, palette, target, signal }) {
  const started = performance.now();
  let text = "";
  let tokens = 0;
  let usage = null;
  let stats = null;
  let sawExitTokens = false;
  await streamChat(
    body,
    apiKey,
    (chunk) => {
      if (chunk.usage) {
        usage = chunk.usage;
        stats = chunk.early_exit ?? null;
      }
      for (const choice of chunk.choices ?? []) {
        if (choice.delta && choice.delta.content) text += choice.delta.content;
        const entries = choice.exit_tokens;
        if (entries) {
          sawExitTokens = true;
          for (const entry of entries) {
            tokens += 1;
            if (entry.text) target.append(tokenSpan(entry, palette));
          }
        } else if (choice.delta && choice.delta.content) {
          target.append(document.createTextNode(choice.delta.content)); // an older server
        }
        if (choice.early_exit) stats = choice.early_exit;
      }
    },
    signal,
  );
  const seconds = (performance.now() - started) / 1000;
  if (usage) tokens = usage.completion_tokens;
  if (!sawExitTokens && !tokens) tokens = text.split(/\s+/).filter(Boolean).length;
  return { text, tokens, seconds, tokensPerSecond: tokens / Math.max(seconds, 1e-9), stats };
}
