"""The prefix cache's disk tier (`--kv-cache-disk`, engine/kv_disk.py) on a real tiny model: a
restarted engine over the same folder finds a long prompt cached and answers bit for bit as a
cold one (int8 weights: the quantized kernels' bits do not depend on the batch); a corrupted,
truncated or foreign file is a miss and is deleted; the size cap holds; a folder it cannot write
turns the tier off with one warning and serving goes on."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from helpers import run_one_request

from nanoserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from nanoserve.engine.build import build_engine_core
from nanoserve.engine.core import EngineCore
from nanoserve.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
PROMPT = [random.Random(0).randrange(3, 49152) for _ in range(300)]
CACHED = (len(PROMPT) - 1) // 16 * 16  # every full block before the last token


def engine(path: str, disk: Path | None, *, prefix_caching: bool = True,
           disk_bytes: int = 1 << 30) -> EngineCore:
    return build_engine_core(EngineConfig(
        model=ModelConfig(model=path, device="cpu", dtype="float32", quantization="int8"),
        cache=CacheConfig(kv_cache_memory_bytes=64 << 20, enable_prefix_caching=prefix_caching,
                          kv_cache_disk=None if disk is None else str(disk),
                          kv_cache_disk_bytes=disk_bytes),
        scheduler=SchedulerConfig()))


def run(core: EngineCore, prompt: list[int] = PROMPT) -> tuple[Any, int]:
    """(tokens and logprobs, cached tokens) of one request."""
    return run_one_request(core, prompt, PARAMS)


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir: Any) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def cold(llama_dir: str) -> Any:
    return run(engine(llama_dir, None, prefix_caching=False))[0]


def first_life(llama_dir: str, disk: Path) -> list[Path]:
    """An engine that computes the prompt and shuts down (its blocks written): the files."""
    core = engine(llama_dir, disk)
    run(core)
    core.shutdown()
    files = sorted(disk.rglob("*.kv"))
    assert len(files) >= CACHED // 16
    return files


def test_a_restart_finds_the_prompt_on_disk_and_answers_as_a_cold_engine(
        llama_dir: str, cold: Any, tmp_path: Path) -> None:
    first_life(llama_dir, tmp_path)
    core = engine(llama_dir, tmp_path)
    got, cached = run(core)
    assert cached == CACHED
    assert got == cold
    assert core.stats.kv_disk_hits == CACHED // 16 and core.stats.kv_disk_bytes_read > 0


def _chain_files(disk: Path, llama_dir: str) -> list[Path]:
    """The prompt's block files in chain order (the hashes the engine gives its blocks)."""
    from nanoserve.engine.request import Request

    core = engine(llama_dir, None)
    request = Request("x", PROMPT, PARAMS)
    hashes = core.kv_cache.block_hashes(request)[: CACHED // 16]
    (folder,) = [p for p in disk.iterdir() if p.is_dir()]
    return [folder / f"{h.hex()}.kv" for h in hashes]


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_bad_file_is_a_miss_and_is_deleted(llama_dir: str, cold: Any, tmp_path: Path,
                                             damage: str) -> None:
    first_life(llama_dir, tmp_path)
    files = _chain_files(tmp_path, llama_dir)
    bad = files[5]
    data = bytearray(bad.read_bytes())
    if damage == "flip":
        data[-100] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:  # another model's fingerprint in its header
        data[8:24] = bytes(16)
    bad.write_bytes(bytes(data))
    got, cached = run(engine(llama_dir, tmp_path))
    assert cached == 5 * 16  # the blocks before the bad one
    assert got == cold
    assert not bad.exists()


def test_the_size_cap_holds(llama_dir: str, tmp_path: Path) -> None:
    cap = 6 * 1 << 20
    core = engine(llama_dir, tmp_path, disk_bytes=cap)
    for seed in range(4):
        run(core, [random.Random(seed).randrange(3, 49152) for _ in range(400)])
    core.shutdown()
    total = sum(p.stat().st_size for p in tmp_path.rglob("*.kv"))
    assert 0 < total <= cap


def test_a_folder_it_cannot_write_turns_the_tier_off_and_serving_goes_on(
        llama_dir: str, cold: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with caplog.at_level("WARNING", logger="nanoserve"):
        core = engine(llama_dir, blocker / "cache")
        assert run(core)[0] == cold
        core.shutdown()
    assert caplog.text.count("KV disk tier off") == 1


def test_blocks_evicted_from_ram_are_written_and_read_back(llama_dir: str, cold: Any,
                                                           tmp_path: Path) -> None:
    """No shutdown: the prompt's blocks reach the disk because other prompts evict them, and
    the same engine reads them back for the prompt's second coming."""
    core = build_engine_core(EngineConfig(
        model=ModelConfig(model=llama_dir, device="cpu", dtype="float32", quantization="int8"),
        cache=CacheConfig(num_blocks=40, kv_cache_disk=str(tmp_path)),
        scheduler=SchedulerConfig(max_num_batched_tokens=512)))
    run(core)
    for seed in (1, 2):
        run(core, [random.Random(seed).randrange(3, 49152) for _ in range(300)])
    assert core.kv_cache.disk is not None
    core.kv_cache.disk.flush()
    assert core.kv_cache.disk.stats.bytes_written > 0  # (the step stats: at the next step)
    got, cached = run(core)
    assert (got, cached) == (cold, CACHED)
    assert core.stats.kv_disk_hits >= 1
