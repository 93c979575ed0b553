"""Qwen3.5's own MTP head as the draft proposer (`"method": "mtp"`, engine/mtp_drafter.py).

Its drafts equal, at every step, those of a plain PyTorch reference of vLLM's formula run over
the whole sequence so far (transformers' own decoder layer as the head's layer), through chunked
prompts and verify steps with rejected drafts: so the head's KV cache holds what it should at
every position. And the output with the head drafting is the output without drafts, token and
logprob for logprob: greedy and seeded, batched, in chunks, through preemption.

transformers' Qwen3.5 drops a checkpoint's `mtp.*` tensors, so the tiny checkpoint gets them
added here: a head that mostly copies (its fc passes the next token's embedding through and its
layer's outputs are damped), so that on the echoing tiny model (test_spec_hybrid.py's) its
drafts are kept in runs and rejected elsewhere. Real weights' acceptance needs real weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_spec_hybrid import (
    ECHO_DAMPING,
    GREEDY,
    PROMPTS,
    SEEDED,
    assert_drafts_kept_and_rejected,
    write_echo_qwen35,
)

from nanoserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from nanoserve.engine.build import build_engine_core
from nanoserve.engine.core import EngineCore
from nanoserve.engine.drafts import sequence_of
from nanoserve.sampling_params import SamplingParams
from nanoserve.speculative_config import SpeculativeConfig

NUM_DRAFTS = 3
MTP_LAYER_SOURCE = 7  # the tiny model's last full-attention layer, the head's layer's start


def _write(path: Path, tokenizer: Any, with_mtp: bool, copying: bool = True) -> Path:
    """The echoing tiny Qwen3.5 (test_spec_hybrid.py's), and with `with_mtp` a head: one that
    mostly copies (`copying`), or a random one whose layer weighs as much as its input."""
    from safetensors.torch import load_file, save_file

    write_echo_qwen35(path, tokenizer)
    if with_mtp:
        file = path / "model.safetensors"
        tensors = load_file(str(file))
        tensors.update(mtp_tensors(tensors, copying))
        save_file(tensors, str(file), metadata={"format": "pt"})
    return path


def mtp_tensors(tensors: dict[str, torch.Tensor], copying: bool) -> dict[str, torch.Tensor]:
    """A head whose layer is the model's last full-attention layer's weights plus noise, its
    norms stored as offsets (multiplier 1 + w). `copying`: it mostly predicts its input token
    again (fc = [I, small], the layer's outputs damped further); else fc is random and the
    layer's outputs undamped, so every row the layer attends moves the drafts."""
    gen = torch.Generator().manual_seed(68)
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    fc = (torch.cat([torch.eye(hidden), 0.05 * torch.randn(hidden, hidden, generator=gen)], 1)
          if copying else 0.2 * torch.randn(hidden, 2 * hidden, generator=gen))
    out = {"mtp.fc.weight": fc}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{name}.weight"] = 0.2 * torch.rand(hidden, generator=gen)
    prefix = f"model.layers.{MTP_LAYER_SOURCE}."
    for name, value in tensors.items():
        if name.startswith(prefix):
            noise = 0.02 * torch.randn(value.shape, generator=gen)
            damped = name.endswith(("o_proj.weight", "down_proj.weight"))
            scale = 1.0 if not damped else 0.5 if copying else 2 / ECHO_DAMPING
            out["mtp.layers.0." + name[len(prefix):]] = (value + noise) * scale
    return out


@pytest.fixture(scope="module")
def mtp_qwen35(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> Path:
    return _write(tmp_path_factory.mktemp("mtp-qwen35"), default_tokenizer, with_mtp=True)


@pytest.fixture(scope="module")
def random_mtp_qwen35(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> Path:
    return _write(tmp_path_factory.mktemp("random-mtp-qwen35"), default_tokenizer,
                  with_mtp=True, copying=False)


def engine(path: Path, method: str | None, *, quantization: str = "int8", num_blocks: int = 256,
           max_num_batched_tokens: int = 2048, block_size: int = 16) -> EngineCore:
    """An engine on the CPU; `method` names the drafts (None: none)."""
    drafts = None if method is None else SpeculativeConfig.parse(
        {"method": method, "num_speculative_tokens": NUM_DRAFTS})
    return build_engine_core(EngineConfig(
        model=ModelConfig(model=str(path), device="cpu", dtype="float32",
                          quantization=quantization, kernel_tuning="off"),
        cache=CacheConfig(num_blocks=num_blocks, block_size=block_size),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                  draft_proposer=drafts, num_speculative_tokens=NUM_DRAFTS,
                                  speculative_max_rows=64)))


def outputs(core: EngineCore, prompts: dict[str, list[int]], params: SamplingParams
            ) -> dict[str, Any]:
    """Each request's (token ids, logprobs), all added at once."""
    for rid, ids in prompts.items():
        core.add_request(rid, ids, params)
    got: dict[str, Any] = {rid: ([], []) for rid in prompts}
    while core.has_unfinished():
        for out in core.step():
            tokens, logprobs = got[out.request_id]
            got[out.request_id] = (tokens + out.new_token_ids,
                                   logprobs + list(out.new_logprobs or []))
    return got




# -- the reference: vLLM's formula in plain PyTorch, transformers' layer as the head's --------
class Reference:
    """The target (transformers) and the head, over a whole sequence at once."""

    def __init__(self, path: Path) -> None:
        import transformers
        from safetensors.torch import load_file
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path, torch_dtype=torch.float32).eval()
        config = self.model.config
        tensors = load_file(str(path / "model.safetensors"))
        self.head = {k[len("mtp."):]: v for k, v in tensors.items() if k.startswith("mtp.")}
        self.layer = Qwen3_5DecoderLayer(config, MTP_LAYER_SOURCE).eval()
        self.layer.load_state_dict({k[len("layers.0."):]: v for k, v in self.head.items()
                                    if k.startswith("layers.0.")})
        self.eps = config.rms_norm_eps

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self.head[f"{name}.weight"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + w)

    @torch.no_grad()
    def target_states(self, ids: list[int]) -> torch.Tensor:
        """The target's final normed hidden states [len(ids), hidden] (row i sees ids[:i + 1]:
        a sequence's states serve each of its prefixes)."""
        return self.model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]

    @torch.no_grad()
    def drafts(self, ids: list[int], states: torch.Tensor, k: int
               ) -> tuple[list[int], list[float]]:
        """`ids`: the sequence through the token just drawn, `states` the target's at
        ids[:-1] (or more). The head's k drafts after it, each one's margin over the
        runner-up logit."""
        embed = self.model.model.embed_tokens.weight
        tokens = list(ids[1:])  # row i: the state at i, the token at i + 1
        rows = [states[: len(tokens)]]
        drafts, margins = [], []
        for _ in range(k):
            h = torch.cat(rows)
            n = len(tokens)
            x = torch.cat([self._norm(embed[torch.tensor(tokens)], "pre_fc_norm_embedding"),
                           self._norm(h, "pre_fc_norm_hidden")], -1) @ self.head["fc.weight"].T
            positions = torch.arange(n)[None]
            rope = self.model.model.rotary_emb(x[None], positions)
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = self._norm(self.layer(x[None], position_embeddings=rope, attention_mask=mask,
                                        position_ids=positions)[0], "norm")
            logits = out[-1] @ embed.T
            top = logits.topk(2)
            drafts.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            tokens.append(drafts[-1])
            rows.append(out[-1:])
        return drafts, margins


@pytest.mark.parametrize(("head", "chunk"), [("random_mtp_qwen35", 2048),
                                             ("random_mtp_qwen35", 7), ("mtp_qwen35", 7)],
                         ids=["random-whole", "random-chunked", "copying-chunked"])
def test_drafts_equal_the_reference_at_every_step(request: pytest.FixtureRequest, head: str,
                                                  chunk: int) -> None:
    """Exact weights: after every step, each request's drafts are the reference's (compared
    up to the first near tie), prompts in one piece or in chunks of 7, blocks of 4 (so the
    chain's positions often pass a request's blocks). The random head's drafts are rejected
    (all its rows read the target's states); the copying head's are kept in runs (verify
    chunks with accepted and rejected drafts feed its next rows)."""
    path = request.getfixturevalue(head)
    reference = Reference(path)
    core = engine(path, "mtp", quantization="none", max_num_batched_tokens=chunk,
                  block_size=4)
    for rid, ids in list(PROMPTS.items())[:2]:
        core.add_request(rid, ids, GREEDY)
    seen: list[tuple[str, list[int], list[int]]] = []  # (request, sequence, drafts)
    while core.has_unfinished():
        core.step()
        for request in core.scheduler.running:
            # the head's drafts after this step (the core's draft policy takes fewer)
            drafts = list(core.proposer.propose(sequence_of(request), NUM_DRAFTS))
            if drafts:  # (none where the request did not sample: a prompt chunk)
                seen.append((request.request_id, list(request.all_token_ids), drafts))
    final = {rid: max((ids for r, ids, _ in seen if r == rid), key=len) for rid, _, _ in seen}
    states = {rid: reference.target_states(ids) for rid, ids in final.items()}
    compared = 0
    for rid, ids, drafts in seen:
        want, margins = reference.drafts(ids, states[rid], NUM_DRAFTS)
        sure = next((i for i, m in enumerate(margins) if m < 1e-3), NUM_DRAFTS)
        assert drafts[:sure] == want[:sure], (rid, len(ids))
        compared += sure
    assert compared > 100
    if head == "mtp_qwen35":
        assert_drafts_kept_and_rejected(core)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batched_outputs_and_logprobs_equal_without_drafts(mtp_qwen35: Path,
                                                           params: SamplingParams) -> None:
    off = outputs(engine(mtp_qwen35, None), PROMPTS, params)
    on_engine = engine(mtp_qwen35, "mtp")
    assert outputs(on_engine, PROMPTS, params) == off
    assert_drafts_kept_and_rejected(on_engine)


def test_chunked_prefill_and_preemption(mtp_qwen35: Path) -> None:
    """Chunks of 7 tokens and a cache too small for every request: preempted requests
    recompute from the start (the head's cache too), drafts or not."""
    off = outputs(engine(mtp_qwen35, None), PROMPTS, SEEDED)
    on_engine = engine(mtp_qwen35, "mtp", num_blocks=9, max_num_batched_tokens=7)
    assert outputs(on_engine, PROMPTS, SEEDED) == off
    assert on_engine.stats.num_preemptions > 0, "the small cache should preempt"
    assert_drafts_kept_and_rejected(on_engine)


def test_a_checkpoint_without_the_head_is_refused(tmp_path: Path,
                                                  default_tokenizer: Any) -> None:
    path = _write(tmp_path / "plain", default_tokenizer, with_mtp=False)
    with pytest.raises(ValueError, match=r"speculative_config.method 'mtp' needs the "
                                         r"checkpoint's MTP head \(mtp\.\* weights\)"):
        engine(path, "mtp")
    # without the method, a checkpoint's head is dropped as transformers drops it
    assert outputs(engine(_write(tmp_path / "with", default_tokenizer, with_mtp=True), None),
                   {"a": PROMPTS["p0"]}, GREEDY) == outputs(engine(path, None),
                                                             {"a": PROMPTS["p0"]}, GREEDY)


def test_config_spells_it_as_vllm() -> None:
    """`mtp`, and vLLM's older per-model names read as it; its fields are the common ones."""
    for method in ("mtp", "qwen3_next_mtp", "qwen3_5_mtp"):
        config = SpeculativeConfig.parse({"method": method, "num_speculative_tokens": 2})
        assert config is not None and config.method == "mtp"
        assert config.num_speculative_tokens == 2
    with pytest.raises(ValueError, match="prompt_lookup_min is not a field of method 'mtp'"):
        SpeculativeConfig.parse({"method": "mtp", "prompt_lookup_min": 2})
