"""The output path with `return_progress`: an engine output that carries only a prefill chunk's
progress (no tokens, no finish) becomes an update with no text that carries it, and touches no
text, no count and no timing; the progress of a request's later samples (n > 1) is not sent."""

from __future__ import annotations

from typing import Any

from nanoserve.output.processor import OutputProcessor, RequestState
from nanoserve.protocol import EngineCoreOutput, PromptProgress
from nanoserve.sampling_params import RequestOutputKind, SamplingParams

DELTA = SamplingParams(max_tokens=4, return_progress=True, output_kind=RequestOutputKind.DELTA)


class Recorder:
    """A TimingObserver that notes every call."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def first_token(self, seconds: float, num_prompt_tokens: int) -> None:
        self.calls.append("first_token")

    def inter_token(self, seconds: float, num_tokens: int) -> None:
        self.calls.append("inter_token")

    def generated(self, num_tokens: int) -> None:
        self.calls.append(f"generated {num_tokens}")

    def finished(self, state: RequestState) -> None:
        self.calls.append("finished")

    def pooled(self, seconds: float, num_prompt_tokens: int) -> None:
        self.calls.append("pooled")


def chunk(request_id: str, processed: int, tokens: list[int] | None = None,
          finish: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, tokens or [], finish, num_cached_tokens=32,
                            prompt_progress=PromptProgress(200, 32, processed, processed // 10))


def test_progress_only_outputs_touch_no_text_and_no_timing(default_tokenizer: Any) -> None:
    recorder = Recorder()
    processor = OutputProcessor(default_tokenizer, recorder)
    processor.add_request("r", None, [5] * 200, DELTA)
    (update,) = processor.process([chunk("r", 96)]).outputs
    assert update.outputs == [] and not update.finished
    assert update.prompt_progress == PromptProgress(200, 32, 96, 9)
    state = processor.requests["r"]
    assert state.metrics.first_token_time is None and state.metrics.num_generation_tokens == 0
    assert recorder.calls == [] and state.samples[0].text == ""
    ids = default_tokenizer.encode("Hello world", add_special_tokens=False)
    (update,) = processor.process([chunk("r", 200, ids[:1])]).outputs  # the first token
    assert update.prompt_progress == PromptProgress(200, 32, 200, 20)
    assert update.outputs[0].text == "Hello" and update.num_cached_tokens == 32
    assert recorder.calls == ["first_token", "generated 1"]
    (update,) = processor.process([EngineCoreOutput("r", ids[1:], "length")]).outputs
    assert update.prompt_progress is None and update.outputs[0].text == " world"
    assert update.finished and "r" not in processor.requests


def test_cumulative_updates_carry_it_beside_the_samples(default_tokenizer: Any) -> None:
    processor = OutputProcessor(default_tokenizer)
    processor.add_request("c", None, [5] * 200, SamplingParams(max_tokens=4,
                                                               return_progress=True))
    (update,) = processor.process([chunk("c", 64)]).outputs
    assert update.prompt_progress is not None and update.prompt_progress.processed == 64
    assert [(o.text, o.token_ids) for o in update.outputs] == [("", [])]


def test_only_the_first_sample_reports(default_tokenizer: Any) -> None:
    processor = OutputProcessor(default_tokenizer)
    engine_ids = [e for e, _, _ in processor.add_request(
        "n", None, [5] * 200, SamplingParams(n=2, max_tokens=4, return_progress=True,
                                             output_kind=RequestOutputKind.DELTA))]
    assert processor.process([chunk(engine_ids[1], 200)]).outputs == []
    (update,) = processor.process([chunk(engine_ids[0], 128)]).outputs
    assert update.prompt_progress is not None and update.prompt_progress.processed == 128
