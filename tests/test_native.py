"""The C++ kernels' build: a machine that cannot build them says why and keeps the plain path."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from nanoserve.native import build_lock, missing_build_tool


def test_a_missing_compiler_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler-g++")
    assert missing_build_tool() == "no C++ compiler ('no-such-compiler-g++' is not on PATH)"


def test_without_a_compiler_quantized_weights_fall_back_to_float() -> None:
    """A fresh interpreter with no compiler: one warning, and the model still multiplies."""
    script = (
        "import warnings, torch\n"
        "from nanoserve.model.quant_linear import QuantizedWeight\n"
        "w = torch.randn(8, 64)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    q = QuantizedWeight.from_float(w)\n"
        "assert not q.is_packed\n"
        "print(caught[0].message)\n"
        "x = torch.randn(3, 64)\n"
        "assert torch.allclose(q.matmul(x), x @ q.dequantize().T, atol=1e-5)\n"
    )
    env = {"CXX": "no-such-compiler-g++", "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "C++ kernels unavailable (no C++ compiler" in out.stdout


def test_a_build_killed_mid_way_does_not_block_the_next(tmp_path: Path) -> None:
    """torch's build lock is a file that a killed build leaves behind, and torch waits on it
    forever; a build that died holding ours leaves nothing that blocks the next build."""
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time, pathlib\n"
         "from nanoserve.native import build_lock\n"
         f"with build_lock(pathlib.Path({str(tmp_path)!r})):\n"
         f"    pathlib.Path({str(tmp_path / 'lock')!r}).touch()  # torch's, as in its build\n"
         "    print('held', flush=True)\n"
         "    time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    entered = threading.Event()

    def build() -> None:
        with build_lock(tmp_path):
            entered.set()

    waiting = threading.Thread(target=build, daemon=True)
    waiting.start()
    assert not entered.wait(0.5)  # a live build holds the lock
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert entered.wait(30)  # its death frees it
    assert not (tmp_path / "lock").exists()
