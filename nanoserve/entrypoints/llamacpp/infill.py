"""POST /infill, llama-server's code completion (llama.vscode, Tabby, Zed and others send it):
the prompt llama-server builds from the prefix, the suffix and the project's other files
(serving/infill_prompt.py), generated as any other request, answered in llama-server's
shape: `content`, `tokens_predicted`, `tokens_evaluated`, `stop_type`, `timings`, ...; a
stream sends one `data:` event per piece and a last one with `stop: true` (no `[DONE]`).

Editors' stop rules, checked on the text as it comes: `n_indent` ends the output at a new line
indented less (that line cut off, also from a stream: its text is held until its indentation
is known, where llama-server has already sent it), `t_max_predict_ms` at the first new line
past that time. `n_predict: 0` only fills the prefix cache (llama.vscode warms it so), as
there.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.entrypoints.llamacpp.protocol import InfillRequest, unsupported_samplers
from nanoserve.entrypoints.serving.chat_input import SamplingInput
from nanoserve.entrypoints.serving.disconnect import until_disconnect
from nanoserve.entrypoints.serving.engine_errors import SERVING_ERRORS, api_error_of
from nanoserve.entrypoints.serving.errors import bad_request, sse_error
from nanoserve.entrypoints.serving.infill_prompt import (
    ExtraFile,
    bos_added,
    infill_ids,
    mixed_ids,
    plain_tokenizer,
)
from nanoserve.entrypoints.serving.llama_sampler_fields import (
    llama_samplers,
    with_llama_defaults,
)
from nanoserve.entrypoints.serving.request_params import sampling_params
from nanoserve.entrypoints.serving.server_context import ServerContext
from nanoserve.entrypoints.serving.token_limits import resolve_max_tokens
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class InfillRun:
    """One infill's output so far, with the editors' stop rules applied to it."""

    n_indent: int
    t_max_predict_ms: int
    text: str = ""  # what the client has, or will get
    held: str = ""  # a new line's text while its indentation is unknown (n_indent)
    at_line_start: bool = False  # after a new line, before its first other character
    tokens: list[int] = field(default_factory=list)
    num_cached: int = 0
    stop_type: str = "none"  # llama-server's: eos | word | limit | none
    stopping_word: str = ""
    started: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    finished: float | None = None

    def take(self, out: RequestOutput) -> str:
        """The text to send for one update; sets `stop_type` once the output ends."""
        if not out.outputs:  # (a prompt's progress only)
            return ""
        sample = out.outputs[0]
        self.num_cached = max(self.num_cached, out.num_cached_tokens)
        self.tokens += sample.token_ids
        if sample.token_ids and self.first_token is None:
            self.first_token = time.monotonic()
        sent = self._with_indent_rule(sample.text)
        if self.stop_type == "none" and "\n" in sent and self._past_time_limit():
            self.stop_type = "limit"
        if self.stop_type == "none" and sample.finished:
            self.stop_type = _stop_type(sample.finish_reason, sample.stop_reason)
            if isinstance(sample.stop_reason, str):
                self.stopping_word = sample.stop_reason
            sent += self.held  # the last line's indentation can no longer matter
            self.held = ""
        if self.stop_type != "none":
            self.finished = time.monotonic()
        self.text += sent
        return sent

    def _with_indent_rule(self, piece: str) -> str:
        """`piece` less what the indentation rule holds or cuts: each line after a new line
        is held until its first character that is not a space or tab (a new line counts, as
        in llama-server), then sent if indented at least `n_indent`, else cut off, ending
        the output."""
        if self.n_indent <= 0:
            return piece
        out = ""
        for char in piece:
            if not self.at_line_start:
                out += char
                self.at_line_start = char == "\n"
                continue
            if char in " \t":
                self.held += char
                continue
            if len(self.held) < self.n_indent:
                self.held = ""
                self.stop_type = "limit"
                return out
            out += self.held + char
            self.held = ""
            self.at_line_start = char == "\n"
        return out

    def _past_time_limit(self) -> bool:
        return (self.t_max_predict_ms > 0 and self.first_token is not None
                and (time.monotonic() - self.first_token) * 1000 > self.t_max_predict_ms)


def _stop_type(finish_reason: str | None, stop_reason: int | str | None) -> str:
    if finish_reason == "stop":
        return "word" if isinstance(stop_reason, str) else "eos"
    return "limit"


def prepare_infill(ctx: ServerContext, req: InfillRequest) -> tuple[list[int], SamplingParams]:
    """The checks, the prompt's ids and the sampling parameters."""
    ctx.check_model(req.model)
    fim = ctx.fim_tokens
    if fim.missing():
        raise bad_request("Infill is not supported by this model: " + " ".join(
            f"{role} token is missing." for role in fim.missing()) + " (it needs the model's "
            "fill-in-the-middle tokens, as a code model's vocabulary has them)", "model")
    for name, value, least in (("n_predict", req.n_predict, -1), ("n_indent", req.n_indent, 0),
                               ("t_max_predict_ms", req.t_max_predict_ms, 0)):
        if value < least:
            raise bad_request(f"{name} must be at least {least}, got {value}", name)
    for name, value in unsupported_samplers(req):
        raise bad_request(f"{name} is not supported on /infill (got {value}); leave it at "
                          "its off value", name)
    plain = plain_tokenizer(ctx.tokenizer)
    prefix = mixed_ids(req.input_prefix, plain)
    suffix = mixed_ids(req.input_suffix, plain)
    for name, ids in (("input_prefix", prefix), ("input_suffix", suffix)):
        bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
        if bad:
            raise bad_request(f"{name} token id {bad[0]} is out of vocabulary (ids must be in "
                              f"[0, {ctx.vocab_size}))", name)
    prompt = ctx.tokenizer.encode(req.prompt, add_special_tokens=False) if req.prompt else []
    asked = None if req.n_predict < 0 else req.n_predict
    ids = infill_ids(fim, plain, prefix, suffix,
                     [ExtraFile(chunk.text, chunk.filename) for chunk in req.input_extra],
                     prompt, context_len=ctx.max_model_len, max_tokens=asked,
                     bos=bos_added(ctx.tokenizer))
    # n_predict 0 fills the cache with the prompt: one token generated, none answered
    max_tokens = resolve_max_tokens(ctx, len(ids), None if asked is None else max(1, asked),
                                    is_cap=True)
    fields = SamplingInput(
        max_tokens=max_tokens, max_tokens_is_cap=True, temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k or -1, min_p=req.min_p,
        repetition_penalty=req.repeat_penalty,
        llama_samplers=with_llama_defaults(llama_samplers(req)),
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        seed=None if req.seed < 0 else req.seed, stop=req.stop or None,
        ignore_eos=req.ignore_eos, stream=req.stream)
    return ids, sampling_params(ctx, fields, max_tokens=max_tokens,
                                output_kind=RequestOutputKind.DELTA)


async def create_infill(ctx: ServerContext, req: InfillRequest, raw: Request) -> Response:
    ids, params = prepare_infill(ctx, req)
    ctx.check_capacity()
    run = InfillRun(req.n_indent, req.t_max_predict_ms)
    updates = _updates(ctx, f"infill-{uuid.uuid4().hex}", ids, params, run,
                       warm_only=req.n_predict == 0)
    if req.stream:
        return StreamingResponse(_stream(ctx, req, ids, run, updates),
                                 media_type="text/event-stream")

    async def drain() -> None:
        async for _ in updates:
            pass

    await until_disconnect(raw, drain())
    return JSONResponse(_final(ctx, req, ids, run, content=run.text))


async def _updates(ctx: ServerContext, request_id: str, ids: list[int], params: SamplingParams,
                   run: InfillRun, warm_only: bool) -> AsyncIterator[str]:
    """Each update's text to send, until the output ends or a stop rule ends it (the engine's
    request then aborted, as the generator closes)."""
    generator = ctx.engine.generate(request_id, None, ids, params)
    try:
        async for out in generator:  # (leaving it closes it: the engine's request aborted)
            if warm_only:
                run.tokens, run.stop_type = [], "limit"
                run.finished = time.monotonic()
                continue
            piece = run.take(out)
            yield piece
            if run.stop_type != "none":
                return
    finally:
        await generator.aclose()  # type: ignore[attr-defined]


async def _stream(ctx: ServerContext, req: InfillRequest, ids: list[int], run: InfillRun,
                  updates: AsyncIterator[str]) -> AsyncGenerator[str, None]:
    sent_tokens = 0
    try:
        async for piece in updates:
            new_tokens = run.tokens[sent_tokens:]
            sent_tokens = len(run.tokens)
            if piece or new_tokens:
                yield _event({"index": 0, "content": piece, "tokens": new_tokens,
                              "stop": False, "id_slot": -1,
                              "tokens_predicted": len(run.tokens),
                              "tokens_evaluated": len(ids)})
        yield _event(_final(ctx, req, ids, run, content="", tokens=[]))
    except SERVING_ERRORS as e:
        yield sse_error(api_error_of(e))


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _final(ctx: ServerContext, req: InfillRequest, ids: list[int], run: InfillRun,
           content: str, tokens: list[int] | None = None) -> dict[str, Any]:
    """llama-server's last answer of a request (in a stream, its last event: the text and
    tokens went in the events before it)."""
    end = run.finished or time.monotonic()
    first = run.first_token or end
    prompt_ms = (first - run.started) * 1000
    predicted_ms = (end - first) * 1000
    prompt_n = len(ids) - run.num_cached
    if tokens is None:
        tokens = run.tokens if req.return_tokens else []
    body = {
        "index": 0, "content": content, "tokens": tokens,
        "id_slot": 0, "stop": True, "model": ctx.model_name,
        "tokens_predicted": len(run.tokens), "tokens_evaluated": len(ids),
        "generation_settings": {
            "n_predict": req.n_predict, "temperature": req.temperature, "top_k": req.top_k,
            "top_p": req.top_p, "min_p": req.min_p, "seed": req.seed, "stop": req.stop,
            "n_indent": req.n_indent, "t_max_predict_ms": req.t_max_predict_ms,
            "stream": req.stream},
        "prompt": ctx.tokenizer.decode(ids, skip_special_tokens=False),
        "has_new_line": "\n" in run.text, "truncated": False, "stop_type": run.stop_type,
        "stopping_word": run.stopping_word, "tokens_cached": len(ids) + len(run.tokens),
        "timings": {
            "cache_n": run.num_cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / max(1, prompt_n),
            "prompt_per_second": 1000 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": len(run.tokens), "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / max(1, len(run.tokens)),
            "predicted_per_second": (1000 * len(run.tokens) / predicted_ms
                                     if predicted_ms > 0 else 0.0)}}
    if req.response_fields:
        return _picked(body, req.response_fields)
    return body


def _picked(body: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """llama-server's `response_fields`: each path present ("a/b" reads body["a"]["b"]), keyed
    by the path as given; absent ones left out."""
    picked: dict[str, Any] = {}
    for path in paths:
        value: Any = body
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            picked[path] = value
    return picked
