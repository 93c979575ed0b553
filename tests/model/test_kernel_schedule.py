"""The kernels' schedule (csrc/schedule.h) changes when bytes move and how work is split, never a
bit of an output: every candidate the tuner may choose, on every weight layout and every tier
this CPU has, at row counts around the kernels' edges (1, 8, 15, 16, 17, 64), an LM head's
many output rows, decode attention on each cache type, and a whole model's one-region decode
stack, gives `torch.equal` results to the default schedule's. And a module that was never
given a schedule runs today's constants."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_engine
from test_quant_kernels import ALL_TYPES, TYPE_IDS, make_raw

from nanoserve import native
from nanoserve.kernel_tuning.schedule import (
    AMX_MIN_ROWS,
    ATTENTION_BLOCK_TOKENS,
    ATTENTION_HINTS,
    DEFAULT,
    GRAIN_BYTES,
    LAYOUT_OF_TYPE,
    PAIRS_MIN_ROWS,
    SPIN_US,
    WIDE_MIN_ROWS,
    Schedule,
    prefetch_candidates,
)
from nanoserve.model.quant_linear import WIDE_TYPES
from nanoserve.sampling_params import SamplingParams

ROW_COUNTS = (1, 8, 15, 16, 17, 64)
N, K = 40, 512  # five 8-row groups: a pair and one alone in the avx512 tier


@pytest.fixture(autouse=True)
def default_schedule_after() -> Any:
    yield
    native.set_kernel_schedule(DEFAULT.flat())


def modules(kernel: str) -> list[Any]:
    """This kernel's module for every tier the CPU runs (the avx2 one always)."""
    if native.missing_build_tool() is not None:
        pytest.skip(f"the kernels cannot build here: {native.missing_build_tool()}")
    tiers = native.available_tiers() if kernel in native.TIERED_KERNELS else ["avx2"]
    found = [native.load_kernels(kernel, tier) for tier in tiers]
    assert all(m is not None for m in found)
    return found


def every_weight_schedule(ggml_type: int) -> list[Schedule]:
    """Every prefetch candidate for this type's layout (at one row and at more), with the
    pairs kernel from one row and from 16, every pairs, tiles (amx tiers) and wide threshold
    and every task grain."""
    layout = LAYOUT_OF_TYPE[ggml_type]
    out = [dataclasses.replace(DEFAULT.with_prefetch(layout, 1, p).with_prefetch(layout, 8, p),
                               pairs_min_rows=pairs)
           for p in prefetch_candidates() for pairs in (PAIRS_MIN_ROWS[0], PAIRS_MIN_ROWS[-1])]
    out += [dataclasses.replace(DEFAULT, pairs_min_rows=pairs) for pairs in PAIRS_MIN_ROWS]
    out += [dataclasses.replace(DEFAULT, amx_min_rows=rows) for rows in AMX_MIN_ROWS]
    out += [dataclasses.replace(DEFAULT, wide_min_rows=w) for w in WIDE_MIN_ROWS]
    out += [dataclasses.replace(DEFAULT, grain_bytes=g) for g in GRAIN_BYTES]
    return out


def test_a_module_starts_on_the_default_schedule() -> None:
    """Today's constants are the defaults, the same in C++ and Python ("off" runs them): every
    module of a fresh process, before anything sets a schedule."""
    modules("quant_matmul")  # (built, or a skip)
    script = ("import json; from nanoserve import native\n"
              "print(json.dumps({f'{k} {t}': native.load_kernels(k, t).get_schedule()\n"
              "  for k in ('quant_matmul', 'decode_layers', 'paged_attention',\n"
              "            'delta_net', 'hybrid_layers')\n"
              "  for t in (native.available_tiers() if k in native.TIERED_KERNELS\n"
              "            else ['avx2'])}))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-1000:]
    for name, schedule in json.loads(done.stdout.strip().splitlines()[-1]).items():
        assert schedule == DEFAULT.flat(), name
    with pytest.raises(RuntimeError, match="wide_min_rows is at least 16"):
        modules("quant_matmul")[0].set_schedule(
            [*DEFAULT.flat()[:-6], 8, *DEFAULT.flat()[-5:]])
    with pytest.raises(RuntimeError, match="delta_net_strip_columns is 8, 16, 32 or 64"):
        modules("delta_net")[0].set_schedule([*DEFAULT.flat()[:-1], 24])


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=TYPE_IDS)
def test_every_weight_schedule_gives_the_same_products(ggml_type: int) -> None:
    raw = torch.from_numpy(make_raw(ggml_type, N, K, seed=3).reshape(-1))
    inputs = {rows: torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
              for rows in ROW_COUNTS}
    for module in modules("quant_matmul"):
        packed = module.repack(raw, ggml_type, N, K)
        wide = module.widen(packed, ggml_type, N, K) if ggml_type in WIDE_TYPES else None
        native.set_kernel_schedule(DEFAULT.flat())
        expected = {(rows, w is None): module.packed_matmul(x, packed, ggml_type, N, K, w)
                    for rows, x in inputs.items() for w in (wide, None)}
        for schedule in every_weight_schedule(ggml_type):
            native.set_kernel_schedule(schedule.flat())
            for (rows, narrow), product in expected.items():
                got = module.packed_matmul(inputs[rows], packed, ggml_type, N, K,
                                           None if narrow else wide)
                assert torch.equal(got, product), (module.cpu_tier, rows, narrow, schedule)


@pytest.mark.parametrize("ggml_type", [8, 14], ids=["Q8_0", "Q6_K"])
def test_an_lm_heads_products_are_the_same_under_every_schedule(ggml_type: int) -> None:
    """Many output rows (split over the threads by the grain) and the LM heads' types."""
    n, k = 4096, 256
    raw = torch.from_numpy(make_raw(ggml_type, n, k, seed=5).reshape(-1))
    for module in modules("quant_matmul"):
        packed = module.repack(raw, ggml_type, n, k)
        for rows in (1, 8, 17):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            native.set_kernel_schedule(DEFAULT.flat())
            expected = module.packed_matmul(x, packed, ggml_type, n, k, None)
            for schedule in every_weight_schedule(ggml_type):
                native.set_kernel_schedule(schedule.flat())
                assert torch.equal(module.packed_matmul(x, packed, ggml_type, n, k, None),
                                   expected), (rows, schedule)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_decode_attention_is_the_same_under_every_attention_schedule(dtype: torch.dtype) -> None:
    """Every prefetch hint, at every walk step (test_attention_blocking.py: the steps alone)."""
    (module,) = modules("paged_attention")
    heads, kv_heads, dim, block, blocks = 8, 2, 64, 16, 64
    row = dim + 4 if dtype == torch.int8 else dim  # an int8 row carries its scale
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.int8:
        k = torch.randint(-127, 128, (kv_heads, blocks, block, row), dtype=torch.int8,
                          generator=gen)
        v = torch.randint(-127, 128, (kv_heads, blocks, block, row), dtype=torch.int8,
                          generator=gen)
        for cache in (k, v):  # the row's scale bytes: a small positive float32
            cache[..., dim:] = torch.full(cache.shape[:-1], 0.01).view(torch.int32).unsqueeze(
                -1).view(torch.int8)
    else:
        k = torch.randn(kv_heads, blocks, block, row, generator=gen).to(dtype)
        v = torch.randn(kv_heads, blocks, block, row, generator=gen).to(dtype)
    table = torch.randperm(blocks, generator=gen).to(torch.int32).reshape(4, 16)
    lens = torch.tensor([1, 77, 256, 200], dtype=torch.int32)
    q = torch.randn(4, heads, dim, generator=gen)
    expected = torch.empty_like(q)
    module.decode_attention(q, k, v, table, lens, dim ** -0.5, expected)
    for hint in ATTENTION_HINTS:
        for tokens in ATTENTION_BLOCK_TOKENS:
            native.set_kernel_schedule(dataclasses.replace(
                DEFAULT, attention_hint=hint, attention_block_tokens=tokens).flat())
            out = torch.empty_like(q)
            module.decode_attention(q, k, v, table, lens, dim ** -0.5, out)
            assert torch.equal(out, expected), (hint, tokens)


def model_schedules() -> list[Schedule]:
    """Schedules that move every knob of a one-region decode at once, and each knob alone."""
    out = [dataclasses.replace(DEFAULT, spin_us=spin) for spin in SPIN_US]
    out += [dataclasses.replace(DEFAULT, attention_hint=hint) for hint in ATTENTION_HINTS]
    out += [dataclasses.replace(DEFAULT, attention_block_tokens=t)
            for t in ATTENTION_BLOCK_TOKENS[1:]]
    for i, p in enumerate(prefetch_candidates()[::5]):
        s = DEFAULT
        for ggml_type in (8, 3):
            s = s.with_prefetch(LAYOUT_OF_TYPE[ggml_type], 1, p).with_prefetch(
                LAYOUT_OF_TYPE[ggml_type], 8, p)
        out.append(dataclasses.replace(s, wide_min_rows=64, grain_bytes=4096, spin_us=0,
                                       pairs_min_rows=1, attention_block_tokens=(
                                           ATTENTION_BLOCK_TOKENS[i % 3])))
    return out


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16", "int8"])
def test_a_whole_model_decodes_the_same_under_every_schedule(tiny_model_dir: Any,
                                                            kv_cache_dtype: str) -> None:
    """The one-region decode stack (few tokens), its dispatcher path (prefill chunks) and the
    LM head: the same tokens and the same logprobs, bit for bit."""
    path: Path = tiny_model_dir("llama")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = {f"p{n}": list(range(5, 5 + n)) for n in (1, 9, 40)}

    def run(schedule: Schedule) -> dict[str, list[Any]]:
        engine = make_engine(path, quantization="int8", kv_cache_dtype=kv_cache_dtype,
                             max_num_batched_tokens=24)
        native.set_kernel_schedule(schedule.flat())  # over what the engine's start set
        for request_id, ids in prompts.items():
            engine.add_request(request_id, ids, params)
        out: dict[str, list[Any]] = {r: [] for r in prompts}
        while engine.has_unfinished():
            for o in engine.step():
                assert o.new_logprobs is not None
                out[o.request_id] += [(e.token_id, e.logprob, e.top_ids, e.top_logprobs)
                                      for e in o.new_logprobs]
        return out

    expected = run(DEFAULT)
    for schedule in model_schedules():
        assert run(schedule) == expected, schedule


@pytest.mark.parametrize("tier", sorted({"avx2", native.kernel_tier()}))
def test_the_streaming_matmuls_hold_the_schedules_prefetch_instructions(tier: str) -> None:
    """Every hint of the weights' prefetch is in each streaming matmul kernel (a `_group` or
    `_pair` kernel or `matmul_groups` with Stream = true, wherever its block loop was
    compiled): a compiler that merged the hint switch's cases into one prefetch of a loaded hint
    dropped them all (GCC 12 at -O3, before schedule.h gave each case its own asm statement),
    and every weight hint the tuner timed did nothing."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    module = native.load_kernels("quant_matmul", tier)
    assert module is not None, tier
    listing = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", module.__file__],
                             capture_output=True, text=True, check=True).stdout
    streaming = re.compile(r"<void \w+::(u4_group|s8_group|u4_pair|s8_pair|matmul_groups)<"
                           r"[^@]*, true>\(")
    kernels = [body for body in listing.split("\n\n")
               if streaming.search(body.split("\n", 1)[0])
               and re.search(r"\b(vpmaddubsw|vpdpbusd)\b", body)]
    assert kernels, "no streaming kernel's block loop found in the module"
    for body in kernels:
        for instruction in ("prefetchnta", "prefetcht0", "prefetcht1", "prefetcht2"):
            assert instruction in body, (body.split("\n", 1)[0], instruction)
