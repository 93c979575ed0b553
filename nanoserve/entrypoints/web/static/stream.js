// One streamed answer from /v1/chat/completions: server-sent events in, the answer's text,
// reasoning and figures out.

import { apiFetch, errorText } from "./common.js";

/** The `data:` payloads of a server-sent-event stream, parsed, until `[DONE]`. */
async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replaceAll("\r\n", "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

/**
 * Stream `body` into `answer` ({content, reasoning}), calling `onUpdate` after each piece; a
 * long prompt's `prompt_progress` (asked with `return_progress`) goes to `answer.progress`.
 * Returns the figures shown under the answer: time to first token, tokens/s, finish reason
 * ("stopped" when `signal` aborts, "error" with `answer.error` set when the server refuses).
 */
export async function streamAnswer(body, answer, onUpdate, signal) {
  const started = performance.now();
  let firstAt = null;
  let lastAt = null;
  let tokens = 0;
  let finish = null;
  try {
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), signal,
    });
    if (!response.ok) {
      answer.error = await errorText(response);
      return { finish: "error" };
    }
    for await (const event of sseEvents(response.body)) {
      if (event.error) { // the server failed the request after the stream began
        answer.error = event.error.message ?? "the request failed";
        finish = "error";
        break;
      }
      // continuous usage: each chunk says how many tokens are out so far, so the first token
      // is timed when it is generated, even if its text is held back (a partial stop string)
      const generated = event.usage?.completion_tokens ?? tokens;
      if (generated > tokens) {
        firstAt ??= performance.now();
        lastAt = performance.now();
        tokens = generated;
      }
      if (event.prompt_progress) answer.progress = event.prompt_progress;
      for (const choice of event.choices ?? []) {
        const delta = choice.delta ?? {};
        answer.content += delta.content ?? "";
        answer.reasoning += delta.reasoning ?? delta.reasoning_content ?? "";
        finish = choice.finish_reason ?? finish;
      }
      onUpdate();
    }
  } catch (error) {
    if (error.name !== "AbortError") throw error;
    finish = "stopped";
  }
  return figures(started, firstAt, lastAt, tokens, finish);
}

function figures(started, firstAt, lastAt, tokens, finish) {
  return {
    ttft_ms: firstAt === null ? null : firstAt - started,
    // decode speed: the tokens after the first over the time they took
    tokens_per_s: tokens > 1 && lastAt > firstAt ? (tokens - 1) / ((lastAt - firstAt) / 1000)
      : null,
    tokens,
    finish: finish ?? "unknown",
  };
}
