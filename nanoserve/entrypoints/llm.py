"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, params)` and `LLM.chat`.

    from nanoserve import LLM, SamplingParams
    llm = LLM()  # the default model, SmolLM2-135M-Instruct
    outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=20))
    print(outs[0].outputs[0].text)

Structured outputs: `SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`
(or `regex=`, `choice=`, `grammar=`, `json_object=True`) makes every output match.

Embeddings from the same engine: `llm.embed(["a text", ...])[0].outputs.embedding` (pooled
as `--pooling` says, L2-normalized; `PoolingParams(dimensions=..., normalize=...)` to change).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from nanoserve.engine.build import build_engine_core
from nanoserve.engine_args import EngineArgs
from nanoserve.entrypoints.model_by_name import with_local_model
from nanoserve.entrypoints.offline_images import chat_with_images, has_image_parts
from nanoserve.entrypoints.serving.image_prompt import PromptIds
from nanoserve.model.frontend import load_image_processor
from nanoserve.output.processor import OutputProcessor
from nanoserve.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import RequestOutputKind, SamplingParams
from nanoserve.structured.grammar import check_grammar

# A prompt is text, or a dict with "prompt" (text) or "prompt_token_ids" (pre-tokenized).
Prompt = str | dict[str, Any]
Message = dict[str, Any]


class LLM:
    """An engine core in this process, with a tokenizer and the shared output path."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """`model`: a HF directory or a .gguf file, or a name fetched first (`org/repo`,
        `org/repo:QUANT`, `qwen3.5:0.8b`; None: the default model). The keyword arguments are
        the fields of EngineArgs (device, dtype, max_num_seqs, block_size, revision, ...), with
        the defaults and meanings given there; a name it lacks is a TypeError."""
        self._start(EngineArgs(model=model, **engine_args))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        """An LLM from ready-made EngineArgs (what the CLI builds from its flags)."""
        llm = cls.__new__(cls)
        llm._start(engine_args)
        return llm

    def _start(self, engine_args: EngineArgs) -> None:
        config = with_local_model(engine_args)[0].to_config()
        if config.parallel.data_parallel_size > 1:  # one engine core in this process
            raise ValueError(f"data_parallel_size={config.parallel.data_parallel_size}: LLM "
                             "runs one engine core; several run behind `nanoserve serve "
                             "--data-parallel-size N`")
        self.engine = build_engine_core(config)
        self.tokenizer = self.engine.model_info.tokenizer
        self._request_ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults under the model's generation_config.json (temperature, top_p, ...)."""
        return SamplingParams.from_generation_config(self.engine.model_info.generation_config)

    def _submit(self, processor: OutputProcessor, text: str | None, token_ids: list[int],
                params: SamplingParams) -> str:
        """Register a request with the output path and its sample(s) with the engine."""
        if ((params.bad_words and not params.bad_words_token_ids)
                or (params.uses_dry and not params.dry_breaker_token_ids)):
            params.update_from_tokenizer(self.tokenizer)
        if params.structured_outputs is not None:
            # a bad grammar is a ValueError naming the field now, not a request that the
            # engine finishes with "error" once its compile fails on the worker
            check_grammar(params.structured_outputs, self.engine.structured.compiler.tokenizer)
        request_id = str(next(self._request_ids))
        added: list[str] = []
        try:
            images = token_ids.images if isinstance(token_ids, PromptIds) else ()
            for engine_id, sample_params, leader in processor.add_request(
                    request_id, text, token_ids, params):
                self.engine.add_request(engine_id, list(token_ids), sample_params, leader,
                                        images=images)
                added.append(engine_id)
        except BaseException:
            processor.abort(request_id)
            for engine_id in added:
                self.engine.abort(engine_id)
            raise
        return request_id

    def _step(self, processor: OutputProcessor) -> list[RequestOutput]:
        """One engine step through the output path; stop strings free their blocks at once."""
        result = processor.process(self.engine.step())
        for engine_id in result.to_abort:
            self.engine.abort(engine_id)
        return result.outputs

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True, priority: Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; one RequestOutput per prompt, in order.
        `priority`: one per prompt, as vLLM's (with `scheduling_policy="priority"`)."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        encoded = [self._encode(p) for p in prompts]
        return self._run(encoded, sampling_params, use_tqdm, priority)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             *, use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate. A vision
        model's conversation may hold OpenAI's `image_url` parts (data: URLs), as vLLM's."""
        conversations = cast(list[Sequence[Message]], [messages] if messages and isinstance(
            messages[0], dict) else messages)
        encoded: list[tuple[str | None, list[int]]] = []
        template_kwargs = {"add_generation_prompt": add_generation_prompt,
                           **(chat_template_kwargs or {})}
        for conversation in conversations:
            if has_image_parts(conversation):  # OpenAI's image_url parts (data: URLs)
                encoded.append(chat_with_images(conversation, self.tokenizer,
                                                self._image_processor(), template_kwargs))
                continue
            text = self.tokenizer.apply_chat_template(list(conversation), tokenize=False,
                                                      **template_kwargs)
            # the template already wrote any BOS it wants: add no special tokens again
            encoded.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(encoded, sampling_params, use_tqdm)

    def _image_processor(self) -> Any:
        """The model's image processor (None for a model that reads text only)."""
        if not hasattr(self, "_images"):
            info = self.engine.model_info
            mmproj = self.engine.config.model.mmproj
            self._images = (load_image_processor(info.path, self.tokenizer,
                                                 None if mmproj is None else Path(mmproj))
                            if info.has_vision else None)
        return self._images

    def stream(self, prompt: Prompt | Sequence[Message],
               sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Generate for one prompt (or one chat conversation), yielding text as it settles.

        Closing the iterator early (or an exception in the caller) aborts the request.
        """
        if isinstance(prompt, str | dict):
            text, token_ids = self._encode(prompt)
        else:
            text = self.tokenizer.apply_chat_template(list(prompt), tokenize=False,
                                                      add_generation_prompt=True)
            token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        params = replace(sampling_params or self.get_default_sampling_params(), n=1,
                         output_kind=RequestOutputKind.DELTA)
        processor = OutputProcessor(self.tokenizer)
        request_id = self._submit(processor, text, token_ids, params)
        try:
            while self.engine.has_unfinished() and processor.requests:
                for output in self._step(processor):
                    if output.outputs and output.outputs[0].text:  # (none: a prompt_progress)
                        yield output.outputs[0].text
        finally:
            for engine_id in processor.engine_ids(request_id) or [request_id]:
                self.engine.abort(engine_id)  # no-op once finished

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | None = None) -> list[PoolingRequestOutput]:
        """One embedding per prompt (text, or a dict with "prompt_token_ids"), in order: each
        prompt prefilled once (batched, chunked), its final hidden states pooled by the
        engine's `pooling` ("last" token by default) and L2-normalized; nothing is kept."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = pooling_params or PoolingParams()
        encoded = [self._encode(p)[1] for p in prompts]
        ids = [f"embed-{next(self._request_ids)}" for _ in encoded]
        prompt_of = dict(zip(ids, encoded, strict=True))
        finished: dict[str, PoolingRequestOutput] = {}
        try:
            for request_id, token_ids in prompt_of.items():
                self.engine.add_request(request_id, token_ids, SamplingParams(max_tokens=1),
                                        pooling_params=params)
            while len(finished) < len(ids) and self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.pooled is not None:
                        finished[out.request_id] = PoolingRequestOutput(
                            out.request_id, prompt_of[out.request_id],
                            PoolingOutput(out.pooled), out.num_cached_tokens)
        except BaseException:
            for request_id in ids:  # leave the engine clean for the next call
                self.engine.abort(request_id)
            raise
        return [finished[i] for i in ids]

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (ints)")

    def _run(self, encoded: list[tuple[str | None, list[int]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        params = _params_per_prompt(sampling_params or self.get_default_sampling_params(),
                                    len(encoded))
        if priority is not None:
            if len(priority) != len(encoded):
                raise ValueError(f"got {len(priority)} priorities for {len(encoded)} prompts; "
                                 "give one per prompt")
            params = [replace(p, priority=value) for p, value in zip(params, priority,
                                                                      strict=True)]
        processor = OutputProcessor(self.tokenizer)
        ids = []
        try:
            for (text, token_ids), p in zip(encoded, params, strict=True):
                final_only = replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                ids.append(self._submit(processor, text, token_ids, final_only))
            on_finish = _progress(len(ids), use_tqdm)
            finished: dict[str, RequestOutput] = {}
            while self.engine.has_unfinished():
                for output in self._step(processor):
                    finished[output.request_id] = output
                    on_finish(output)
        except BaseException:
            for request_id in ids:  # leave the engine clean for the next call
                for engine_id in processor.engine_ids(request_id):
                    self.engine.abort(engine_id)
            raise
        return [finished[i] for i in ids]


def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams],
                       count: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; "
                         "give one, or one per prompt")
    return list(params)


def _progress(total: int, enabled: bool) -> Callable[[RequestOutput], None]:
    """A tqdm bar over finished requests (multi-prompt runs only), with output tokens/s."""
    if not enabled or total < 2:
        return lambda _: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
    num_tokens = 0

    def update(output: RequestOutput) -> None:
        nonlocal num_tokens
        num_tokens += len(output.outputs[0].token_ids)
        bar.update(1)
        elapsed = bar.format_dict["elapsed"] or 1e-9
        bar.set_postfix_str(f"output {num_tokens / elapsed:.1f} tok/s")
        if bar.n == total:
            bar.close()

    return update
