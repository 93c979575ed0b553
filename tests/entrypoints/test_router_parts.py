"""The router's parts that need no model: what a --models-dir holds, which options reach each
model's server, the names clients send, and one /metrics out of several."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoserve.entrypoints.router.catalog import (
    chat_template_beside,
    find_models,
    input_modalities,
    mmproj_beside,
)
from nanoserve.entrypoints.router.metrics_merge import merge_expositions
from nanoserve.entrypoints.router.run import child_args
from nanoserve.entrypoints.serving.model_names import ModelNames


def test_a_models_dir_holds_gguf_files_and_model_directories(tmp_path: Path) -> None:
    (tmp_path / "b-model.Q4_1.gguf").write_bytes(b"GGUF")
    (tmp_path / "b-model.Q4_1.jinja").write_text("{{ messages }}")
    (tmp_path / "a-hf").mkdir()
    (tmp_path / "a-hf" / "config.json").write_text("{}")
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "readme.txt").write_text("hi")
    for part in (1, 2):  # a split model: one model, by the name before the part's number
        (tmp_path / f"c-big-Q8_0-{part:05d}-of-00002.gguf").write_bytes(b"GGUF")
    models = find_models(str(tmp_path))
    assert list(models) == ["a-hf", "b-model.Q4_1", "c-big-Q8_0"]
    assert models["c-big-Q8_0"].name == "c-big-Q8_0-00001-of-00002.gguf"
    assert chat_template_beside(models["b-model.Q4_1"]) == tmp_path / "b-model.Q4_1.jinja"
    assert chat_template_beside(models["a-hf"]) is None


def test_a_vision_models_projector_is_found_beside_it(tmp_path: Path) -> None:
    """llama-server's router layout: a subdirectory holding the model and its mmproj; or
    mmproj-<file> beside a model in the directory itself. A projector is no model."""
    (tmp_path / "gemma-3-4b").mkdir()
    (tmp_path / "gemma-3-4b" / "gemma-3-4b-it-Q4_K_M.gguf").write_bytes(b"GGUF")
    (tmp_path / "gemma-3-4b" / "mmproj-F16.gguf").write_bytes(b"GGUF")
    (tmp_path / "small.gguf").write_bytes(b"GGUF")
    (tmp_path / "mmproj-small.gguf").write_bytes(b"GGUF")
    (tmp_path / "text.gguf").write_bytes(b"GGUF")
    models = find_models(str(tmp_path))
    assert list(models) == ["gemma-3-4b", "small", "text"]
    assert mmproj_beside(models["gemma-3-4b"]) == tmp_path / "gemma-3-4b" / "mmproj-F16.gguf"
    assert mmproj_beside(models["small"]) == tmp_path / "mmproj-small.gguf"
    assert mmproj_beside(models["text"]) is None
    assert input_modalities(models["gemma-3-4b"]) == ["text", "image"]
    assert input_modalities(models["text"]) == ["text"]


def test_a_models_dir_that_is_missing_or_empty_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        find_models(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"holds no \.gguf file"):
        find_models(str(tmp_path))


def test_names_clients_send_resolve_with_or_without_ollamas_tag() -> None:
    names = ModelNames({"gemma": Path("/m/gemma.gguf"), "smol.Q4_1": Path("/m/smol.Q4_1.gguf"),
                        "qwen": Path("/m/qwen")})
    assert names.resolve("gemma") == "gemma"
    assert names.resolve("gemma:latest") == "gemma"
    assert names.resolve("gemma.gguf") == "gemma"  # the file's name
    assert names.resolve("gemma.gguf:latest") == "gemma"
    assert names.resolve("smol.Q4_1:latest") == "smol.Q4_1"
    assert names.resolve("qwen:latest") == "qwen"
    assert names.resolve("gemma:7b") is None  # another tag is another model
    assert names.resolve("other") is None
    assert names.resolve("/m/gemma.gguf") is None  # a path is no name here
    # a model named with the default tag (a pull of `smollm2`) answers without it too
    pulled = ModelNames({"smollm2:latest": Path("/s/blobs/sha256-1"), "smollm2:135m": None})
    assert pulled.resolve("smollm2") == pulled.resolve("smollm2:latest") == "smollm2:latest"
    assert pulled.resolve("smollm2:135m") == "smollm2:135m"
    assert pulled.resolve("smollm2:135m:latest") == "smollm2:135m"


def test_a_single_models_server_answers_to_what_the_router_does() -> None:
    """A server started on a path answers to the path, the file's name and stem (the router's
    name for it), each with `:latest`; a served name keeps them."""
    one = ModelNames({"/models/smol.Q4_1.gguf": "/models/smol.Q4_1.gguf"})
    for asked in ("/models/smol.Q4_1.gguf", "smol.Q4_1.gguf", "smol.Q4_1", "smol.Q4_1:latest",
                  "smol.Q4_1.gguf:latest", "/models/smol.Q4_1.gguf:latest"):
        assert one.resolve(asked) == "/models/smol.Q4_1.gguf", asked
    named = ModelNames({"smol": "/models/smol.Q4_1.gguf"})
    assert named.resolve("smol:latest") == named.resolve("smol.Q4_1") == "smol"
    assert named.names == ("smol",)


def test_each_models_server_gets_the_options_but_the_routers_own() -> None:
    argv = ["serve", "--models-dir", "/m", "--models-max=2", "--keep-alive", "60", "--port",
            "9000", "--host", "0.0.0.0", "--allowed-origins", "http://a", "http://b",
            "--max-model-len", "2048", "--no-web-ui", "--api-key", "k", "--served-model-name",
            "x", "--kv-cache-dtype", "int8"]
    assert child_args(argv) == ["--max-model-len", "2048", "--api-key", "k",
                                "--kv-cache-dtype", "int8"]


def test_several_expositions_merge_with_each_family_declared_once() -> None:
    one = ('# HELP x:running Running.\n# TYPE x:running gauge\nx:running{model_name="a"} 1.0\n'
           '# HELP x:tokens Tokens.\n# TYPE x:tokens counter\nx:tokens_total{model_name="a"} 5\n')
    two = one.replace('"a"', '"b"').replace(" 1.0", " 2.0")
    merged = merge_expositions([one, two])
    assert merged.count("# TYPE x:running gauge") == 1
    assert merged.count("# HELP x:tokens Tokens.") == 1
    lines = merged.splitlines()
    assert lines[:4] == ["# HELP x:running Running.", "# TYPE x:running gauge",
                         'x:running{model_name="a"} 1.0', 'x:running{model_name="b"} 2.0']
    assert 'x:tokens_total{model_name="b"} 5' in lines
    assert merge_expositions([]) == ""
