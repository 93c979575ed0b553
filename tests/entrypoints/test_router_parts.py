"""The router's parts that need no model: what a --models-dir holds, which options reach each
model's server, the names clients send, and one /metrics out of several."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoserve.entrypoints.router.catalog import chat_template_beside, find_models, resolve_name
from nanoserve.entrypoints.router.metrics_merge import merge_expositions
from nanoserve.entrypoints.router.run import child_args


def test_a_models_dir_holds_gguf_files_and_model_directories(tmp_path: Path) -> None:
    (tmp_path / "b-model.Q4_1.gguf").write_bytes(b"GGUF")
    (tmp_path / "b-model.Q4_1.jinja").write_text("{{ messages }}")
    (tmp_path / "a-hf").mkdir()
    (tmp_path / "a-hf" / "config.json").write_text("{}")
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "readme.txt").write_text("hi")
    models = find_models(str(tmp_path))
    assert list(models) == ["a-hf", "b-model.Q4_1"]
    assert chat_template_beside(models["b-model.Q4_1"]) == tmp_path / "b-model.Q4_1.jinja"
    assert chat_template_beside(models["a-hf"]) is None


def test_a_models_dir_that_is_missing_or_empty_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        find_models(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"holds no \.gguf file"):
        find_models(str(tmp_path))


def test_names_clients_send_resolve_with_or_without_ollamas_tag() -> None:
    names = {"gemma": Path("g"), "smol.Q4_1": Path("s")}
    assert resolve_name("gemma", names) == "gemma"
    assert resolve_name("gemma:latest", names) == "gemma"
    assert resolve_name("smol.Q4_1:latest", names) == "smol.Q4_1"
    assert resolve_name("gemma:7b", names) is None
    assert resolve_name("other", names) is None


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
