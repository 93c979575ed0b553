"""torch's OpenMP threads spin briefly, not for milliseconds, in every nanoserve process
(nanoserve/__init__.py says why and what was measured); a user's own setting wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# libgomp reads the variable when torch loads it: the value must be in the environment before
SCRIPT = ("import os, nanoserve, torch\n"
          "torch.set_num_threads(2)\n"
          "torch.ones(1 << 16).sum()\n"
          "print(os.environ['GOMP_SPINCOUNT'])\n")


@pytest.mark.parametrize(("ours", "expected"), [(None, "1000"), ("20000", "20000")])
def test_spin_count_is_set_before_torch_loads(ours: str | None, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if ours is not None:
        env["GOMP_SPINCOUNT"] = ours
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected
