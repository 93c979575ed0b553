"""Split GGUF models (`name-00001-of-00003.gguf`, llama.cpp's gguf-split): read from the first
part as the whole file (metadata, tensor bytes, generated tokens), one clear error for each way
the parts can be wrong, and the model path check (model_path.py) on them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_split_files import split_gguf

from nanoserve.model.gguf_file import GGUFFile, GGUFPart
from nanoserve.model.loader import default_model_path, gguf_arch
from nanoserve.model.model_path import resolve_model_path
from nanoserve.sampling_params import SamplingParams

SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
GOLDEN_OUTPUTS = Path(__file__).resolve().parent.parent / "data" / "golden_outputs.json"
TINY_NAMES = tuple(f"blk.{i}.ffn_up.weight" for i in range(9))


@pytest.fixture(scope="module")
def default_split(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The default model (SmolLM2-135M, Q4_1) split in three, written once for the module."""
    return split_gguf(default_model_path(), tmp_path_factory.mktemp("default_split"), 3)


@pytest.fixture(scope="module")
def whole() -> GGUFFile:
    return GGUFFile(default_model_path())


def test_the_default_model_split_in_three_reads_as_the_whole_file(
        default_split: list[Path], whole: GGUFFile) -> None:
    split = GGUFFile(default_split[0])
    assert [p.name for p in default_split] == [
        f"SmolLM2-135M-Instruct.Q4_1-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert split.part_paths == tuple(default_split)
    meta = {k: v for k, v in split.metadata.items() if k not in SPLIT_KEYS}
    assert meta == whole.metadata
    assert {k: split.metadata_types[k] for k in meta} == whole.metadata_types
    assert [split.metadata[k] for k in SPLIT_KEYS] == [0, 3, 272]
    assert list(split.tensors) == list(whole.tensors)
    for name, tensor in whole.tensors.items():
        got = split.tensors[name]
        assert (got.shape, got.ggml_type) == (tensor.shape, tensor.ggml_type), name
        assert np.array_equal(got.data, tensor.data), name
    assert gguf_arch(split) == gguf_arch(whole)
    # llama.cpp's layout: the later parts hold the split keys alone, and every part tensors,
    # read in place from its own mapped file (no copy)
    for index, path in enumerate(default_split):
        part = GGUFPart(path)
        assert [part.metadata[k] for k in SPLIT_KEYS] == [index, 3, 272]
        assert index == 0 or set(part.metadata) == set(SPLIT_KEYS)
        assert len(part.tensors) == (91, 91, 90)[index]
        for name in part.tensors:
            data = split.tensors[name].data
            assert isinstance(data, np.memmap) and Path(str(data.filename)) == path.resolve()


@pytest.mark.slow
def test_llm_on_the_first_part_gives_the_whole_files_greedy_tokens(
        default_split: list[Path]) -> None:
    """The whole file's tokens are the ones tests/data/golden_outputs.json records for it (and
    tests/engine/test_golden_outputs.py holds the engine to): one model load, not two."""
    from nanoserve.entrypoints.llm import LLM

    golden = json.loads(GOLDEN_OUTPUTS.read_text())
    expected = golden["outputs"]["gguf"]["alone"]["greedy-0"]["token_ids"][:6]
    llm = LLM(str(default_split[0]), quantization="gguf", device="cpu", kv_cache_memory_gb=0.02,
              max_model_len=64)
    out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=6),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == golden["prompts"][0]  # the tokenizer read from part 1
    assert out.outputs[0].token_ids == expected


# -- the ways parts go wrong, on a tiny file of 9 tensors ---------------------------------------
def write_tiny_gguf(path: Path, names: tuple[str, ...] = TINY_NAMES) -> Path:
    """A GGUF file of one tiny Q8_0 tensor per name, and a string and a number of metadata."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(len(names))
    rows = np.random.default_rng(0).standard_normal((2, 32), dtype=np.float32)
    for name in names:
        writer.add_tensor(name, gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with `tiny.gguf` and `other.gguf` (its tensors but the last), and each split
    in three and four: `split3/`, `split4/`, `other3/`."""
    root = tmp_path_factory.mktemp("tiny")
    source = write_tiny_gguf(root / "tiny.gguf")
    other = write_tiny_gguf(root / "other.gguf", TINY_NAMES[:-1])
    split_gguf(source, root / "split3", 3)
    split_gguf(source, root / "split4", 4, stem="tiny")
    split_gguf(other, root / "other3", 3, stem="tiny")
    return root


def parts(folder: Path, num_parts: int = 3) -> list[Path]:
    return [folder / f"tiny-{i:05d}-of-{num_parts:05d}.gguf" for i in range(1, num_parts + 1)]


def broken_split(tiny: Path, tmp_path: Path, case: str) -> Path:
    """A copy of `split3/` broken as `case` says; the path to give the reader."""
    folder = shutil.copytree(tiny / "split3", tmp_path / "model")
    first, second, third = parts(folder)
    if case == "missing part":
        second.unlink()
    elif case == "other split.count":  # part 2 of a split in four, where part 2 of 3 goes
        shutil.copy(parts(tiny / "split4", 4)[1], second)
    elif case == "not the first part":
        return second
    elif case == "fewer tensors":  # part 3 of a split of the same model less a tensor
        shutil.copy(parts(tiny / "other3")[2], third)
    elif case == "parts swapped":
        shutil.copy(third, second)
    elif case == "first part renamed":
        return first.rename(folder / "tiny.gguf")
    return first


ERRORS = {
    "missing part": (FileNotFoundError,
                     r"part 2 of 3 of the split GGUF model .*tiny-00001-of-00003\.gguf', "
                     r"tiny-00002-of-00003\.gguf, is missing"),
    "other split.count": (ValueError, r"tiny-00002-of-00003\.gguf' says it is one of 4 parts "
                                      r"\(split\.count\), but the first part says 3"),
    "not the first part": (ValueError, r"tiny-00002-of-00003\.gguf' is part 2 of 3 of a split "
                                       r"GGUF model: give its first part "
                                       r"\(tiny-00001-of-00003\.gguf\)"),
    "fewer tensors": (ValueError, r"tiny-00001-of-00003\.gguf': its 3 parts hold 8 tensors, "
                                  r"but its split\.tensors\.count says 9"),
    "parts swapped": (ValueError, r"tiny-00002-of-00003\.gguf' has split\.no 2, but part 2 of "
                                  r"a split has 1"),
    "first part renamed": (ValueError, r"tiny\.gguf' is the first of 3 parts .* does not end "
                                       r"in '-00001-of-00003\.gguf'"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_each_broken_split_is_one_line_naming_the_file(tiny: Path, tmp_path: Path,
                                                       case: str) -> None:
    path = broken_split(tiny, tmp_path, case)
    error, message = ERRORS[case]
    with pytest.raises(error, match=message) as caught:
        GGUFFile(path)
    assert "\n" not in str(caught.value)


def test_a_tensor_in_two_parts_is_refused(tiny: Path, tmp_path: Path) -> None:
    renamed = (*(f"x.{i}" for i in range(6)), TINY_NAMES[3], "x.7", "x.8")  # part 3: blk.3
    split_gguf(write_tiny_gguf(tmp_path / "dup.gguf", renamed), tmp_path / "dup", 3, "tiny")
    folder = shutil.copytree(tiny / "split3", tmp_path / "model")
    shutil.copy(parts(tmp_path / "dup")[2], parts(folder)[2])
    with pytest.raises(ValueError, match=r"tensor 'blk\.3\.ffn_up\.weight' is in more than one "
                                         r"part \(again in tiny-00003-of-00003\.gguf\)"):
        GGUFFile(parts(folder)[0])


def test_parts_linked_from_a_cache_are_found_by_the_links_names(tiny: Path,
                                                                 tmp_path: Path) -> None:
    """Hugging Face's cache: each name a link to a blob named by its hash; the parts are found
    beside the link given, not beside its target."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for index, part in enumerate(parts(tiny / "split3")):
        blob = shutil.copy(part, blobs / f"{index:064x}")
        (snapshot / part.name).symlink_to(blob)
    first = snapshot / parts(tiny / "split3")[0].name
    assert resolve_model_path(str(first)) == first
    read = GGUFFile(first)
    assert list(read.tensors) == list(GGUFFile(tiny / "tiny.gguf").tensors)
    assert read.part_paths == tuple(parts(snapshot))


def test_the_model_path_check_takes_a_first_part_or_its_folder(tiny: Path,
                                                               tmp_path: Path) -> None:
    first = parts(tiny / "split3")[0]
    assert resolve_model_path(str(first)) == first
    assert resolve_model_path(str(tiny / "split3")) == first
    with pytest.raises(ValueError, match=r"is part 3 of 3 .*\(tiny-00001-of-00003\.gguf\)"):
        resolve_model_path(str(parts(tiny / "split3")[2]))
    path = broken_split(tiny, tmp_path, "missing part")
    with pytest.raises(FileNotFoundError, match=r"tiny-00002-of-00003\.gguf, is missing"):
        resolve_model_path(str(path))
    with pytest.raises(FileNotFoundError, match=r"not exactly one \.gguf model"):
        resolve_model_path(str(path.parent))
