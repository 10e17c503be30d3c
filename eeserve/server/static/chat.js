// One streamed exchange: sends the request, appends each token as a coloured span as it
// arrives, and measures the speed in the page: decode tokens/s from the first token to the
// last (so that a prompt served from the prefix cache does not flatter a second run), and the
// time to the first token. `content` deltas are the answer's text; `exit_tokens` (eeserve extension) say
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
  let firstAt = null;
  let lastAt = null;
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
          const now = performance.now();
          if (entries.length) {
            firstAt = firstAt ?? now;
            lastAt = now;
          }
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
  const firstToken = firstAt === null ? seconds : (firstAt - started) / 1000;
  const decode = lastAt === null ? 0 : (lastAt - firstAt) / 1000;
  // Tokens after the first over the time they took; one token: over the whole request.
  const tokensPerSecond = tokens > 1 && decode > 0 ? (tokens - 1) / decode : tokens / seconds;
  return { text, tokens, seconds, firstToken, tokensPerSecond, stats };
}
