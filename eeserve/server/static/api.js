// Talking to this server from the page: the API key header, OpenAI error bodies, SSE streams.
// The key lives only in the page's input field; it is sent as `Authorization: Bearer <key>`.

export class ApiError extends Error {
  constructor(message, status, param) {
    super(message);
    this.status = status;
    this.param = param ?? null;
  }
}

export function headers(apiKey, json = false) {
  const h = {};
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

async function errorOf(response) {
  let message = `HTTP ${response.status} ${response.statusText}`;
  let param = null;
  try {
    const body = await response.json();
    if (body.error && body.error.message) {
      message = body.error.message;
      param = body.error.param;
    }
  } catch (_) {
    // not JSON: keep the status line
  }
  return new ApiError(message, response.status, param);
}

export async function getJSON(path, apiKey) {
  const r = await fetch(path, { headers: headers(apiKey) });
  if (!r.ok) throw await errorOf(r);
  return r.json();
}

export async function getText(path, apiKey) {
  const r = await fetch(path, { headers: headers(apiKey) });
  if (!r.ok) throw await errorOf(r);
  return r.text();
}

// POST `body` (stream: true) to /v1/chat/completions; onChunk(obj) per event; resolves at [DONE].
export async function streamChat(body, apiKey, onChunk, signal) {
  const r = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: headers(apiKey, true),
    body: JSON.stringify(body),
    signal,
  });
  if (!r.ok) throw await errorOf(r);
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, end);
      buf = buf.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const obj = JSON.parse(data);
        if (obj.error) throw new ApiError(obj.error.message, 500, obj.error.param);
        onChunk(obj);
      }
    }
  }
}
