"""The `/infill` requests whose prompts llama-server built, recorded in
tests/data/llama_server_infill.json (in REQUESTS' order) with the ids it built for each
(nanoserve's prompt builder is checked against them token for token, test_infill.py).
Recorded by running this module against a llama-server (`nanoserve bench`'s build:
`python -m nanoserve.bench.llama_server build`) serving the tiny Qwen3.5 GGUF that
test_infill.py's `tiny_fim_gguf` writes, at `-c 8192 -np 1 --slot-save-path DIR/`:

    python tests/entrypoints/llama_server_infill.py http://127.0.0.1:8931 DIR

Each request asks for one token (`n_predict` 1); llama-server's extra files' budget reads its
own `-n` (-1), not the request's, so the test builds with `max_tokens=None` to match. The ids
are those llama-server evaluated, read from its slot's saved state (`/slots/0?action=save`:
the state file starts with the slot's token ids), as many as its `tokens_evaluated`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RECORDED = Path(__file__).parents[1] / "data" / "llama_server_infill.json"
CONTEXT = 8192  # llama-server's -c

_LONG_PREFIX = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(200))
_LONG_SUFFIX = "".join(f"print(f{i}(2))\n" for i in range(200))
_BIG_FILE = "".join(f"CONSTANT_{i} = {i * 7}  # a value\n" for i in range(600))

REQUESTS: list[dict[str, Any]] = [
    {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n\nprint(add(1, 2))\n",
     "input_extra": [{"filename": "util.py", "text": "import os\n\nHOME = os.environ['HOME']\n"},
                     {"filename": "README.md", "text": "# demo\n"}],
     "prompt": "a"},
    {"input_prefix": "x = ", "input_suffix": ""},
    {"input_prefix": ["def g(", 87, ", y):\n    "], "input_suffix": ["\n", 88]},
    {"input_prefix": "s = '<|fim_prefix|> and <|file_sep|>'\n", "input_suffix": "# <think>\n",
     "input_extra": [{"text": "no name given\n"}]},
    {"input_prefix": _LONG_PREFIX, "input_suffix": _LONG_SUFFIX, "prompt": "  "},
    {"input_prefix": "total = ", "input_suffix": "\n",
     "input_extra": [{"filename": f"consts{i}.py", "text": _BIG_FILE} for i in range(3)]},
]


def record(url: str, slot_dir: Path) -> list[dict[str, Any]]:
    import httpx

    out = []
    for body in REQUESTS:
        reply = httpx.post(url + "/infill", json={**body, "n_predict": 1, "temperature": 0},
                           timeout=300).json()
        saved = httpx.post(url + "/slots/0?action=save", json={"filename": "infill.bin"},
                           timeout=60).json()
        ids = _saved_tokens(slot_dir / "infill.bin", saved["n_saved"])
        out.append({"prompt": reply["prompt"], "ids": ids[:reply["tokens_evaluated"]]})
    return out


def _saved_tokens(path: Path, count: int) -> list[int]:
    """The token ids near the start of llama.cpp's sequence state file: its magic ("ggsq"),
    version 3, four words more, the last of them the token count, then the ids."""
    import struct

    data = path.read_bytes()
    head = struct.unpack("<6i", data[:24])
    assert head[0] == 0x67677371 and head[1] == 3 and head[5] == count, head
    return list(struct.unpack(f"<{count}i", data[24:24 + 4 * count]))


if __name__ == "__main__":
    RECORDED.write_text(json.dumps(record(sys.argv[1], Path(sys.argv[2])),
                                   ensure_ascii=False) + "\n")
