"""An API process serving a GGUF model never imports torch (~2.7 s of a core at each start on a
2-core Zen 3, while the engine core process imports it beside): the HTTP stack, the model's
tokenizer and defaults, the registered logits processors' classes (their arguments are checked
in the API) and structured outputs' grammar checks all load without it."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from nanoserve.entrypoints.serve import serve_api
from nanoserve.model.frontend import load_frontend
from nanoserve.sample.logits_processor import load_processor_classes
from nanoserve.structured.grammar import GrammarTokenizer, check_grammar
from nanoserve.sampling_params import StructuredOutputsParams

frontend = load_frontend(None)
classes = load_processor_classes(())
assert classes, "the registered no_repeat_ngram processor"
grammar_tokenizer = GrammarTokenizer(frontend.tokenizer, len(frontend.tokenizer), ())
check_grammar(StructuredOutputsParams(json={"type": "object"}), grammar_tokenizer)
print("torch" in sys.modules)
"""


def test_the_api_side_of_a_gguf_model_loads_no_torch() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "an API-side module imports torch"
