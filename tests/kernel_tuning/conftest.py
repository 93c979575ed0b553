"""The kernel tuner's tests share one engine per module: the tiny Llama on the int8 kernels."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import make_engine

from nanoserve import native


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Any) -> Any:
    if native.missing_build_tool() is not None:
        pytest.skip(f"the kernels cannot build here: {native.missing_build_tool()}")
    return make_engine(tiny_model_dir("llama"), quantization="int8")
