"""Fill-in-the-middle prompts, token for token as llama-server builds them (its `/infill`, and
for `suffix` on /v1/completions and Ollama's generate), from the model's FIM tokens
(model/fim_tokens.py).

The prompt, in llama-server's repo-level layout (Qwen2.5-Coder's, arXiv 2409.12186):

    [REPO]myproject\\n [SEP]name\\n text (each extra file) [SEP]filename\\n
    [PRE] prefix prompt [SUF] suffix [MID]

the [REPO] part where the vocabulary has that token, the [SEP] parts where it has that one (else
each extra file after a "--- snippet ---" line); the prefix keeps its last 3/4 of a 2,048-token
batch, the suffix its first quarter less the prompt; the extra files fill what the context
leaves after a batch and twice the output (their last tokens kept). The texts are tokenized
without special tokens added or read (a `<|fim_prefix|>` typed in code is text), the request's
`prompt` with them read. These rules are llama-server's (`format_prompt_infill`), kept so that
an editor gets the prompt it gets there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nanoserve.model.fim_tokens import FimTokens

# llama-server's --batch-size default, which sets its prefix and suffix budgets
FIM_BATCH_TOKENS = 2048


@dataclass(frozen=True)
class ExtraFile:
    """A file of the project beside the one edited (llama-server's `input_extra` chunk)."""

    text: str
    filename: str = "tmp"


# between extra files where the vocabulary has no file separator
_SNIPPET_LINE = "\n\n--- snippet ---\n\n"

Tokenize = Callable[[str], list[int]]


def infill_ids(fim: FimTokens, plain: Tokenize, prefix: Sequence[int], suffix: Sequence[int],
               extra: Sequence[ExtraFile], prompt: Sequence[int], *, context_len: int,
               max_tokens: int | None, bos: int | None = None,
               suffix_first: bool = False) -> list[int]:
    """The prompt's ids (see the module). `plain` tokenizes text without special tokens added
    or read; `prefix`, `suffix` and `prompt` come tokenized; `max_tokens` None is llama-server's
    -1 (no count given); `bos` where the vocabulary adds one; `suffix_first`: SPM order
    (llama-server's --spm-infill)."""
    assert fim.prefix is not None and fim.suffix is not None and fim.middle is not None
    extra_ids: list[int] = []
    if fim.repo is not None:
        extra_ids += [fim.repo, *plain("myproject\n")]
    for file in extra:
        if fim.file_sep is not None:
            extra_ids += [fim.file_sep, *plain(file.filename + "\n")]
        else:
            extra_ids += plain(_SNIPPET_LINE)
        extra_ids += plain(file.text)
    if fim.file_sep is not None:
        extra_ids += [fim.file_sep, *plain("filename\n")]
    prefix_take = min(len(prefix), 3 * (FIM_BATCH_TOKENS // 4))
    suffix_take = min(len(suffix), max(0, FIM_BATCH_TOKENS // 4 - (2 + len(prompt))))
    predict = -1 if max_tokens is None else max_tokens
    extra_take = min(max(0, context_len - FIM_BATCH_TOKENS - 2 * predict), len(extra_ids))
    head = [fim.prefix, *prefix[len(prefix) - prefix_take:], *prompt]
    tail = [fim.suffix, *suffix[:suffix_take]]
    first, second = (tail, head) if suffix_first else (head, tail)
    kept_extra = extra_ids[len(extra_ids) - extra_take:]
    # the extra files go before everything, a BOS too (as llama-server puts them)
    return [*kept_extra, *([] if bos is None else [bos]), *first, *second, fim.middle]


def plain_tokenizer(tokenizer: Any) -> Tokenize:
    """`tokenizer`'s encoding of text with no special tokens added and none read."""
    def plain(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False,
                              split_special_tokens=True)["input_ids"])
    return plain


def mixed_ids(value: str | Sequence[str | int], plain: Tokenize) -> list[int]:
    """llama-server's "mixed" input: a text, or a list of texts and token ids."""
    if isinstance(value, str):
        return plain(value)
    ids: list[int] = []
    for part in value:
        ids += plain(part) if isinstance(part, str) else [int(part)]
    return ids


def bos_added(tokenizer: Any) -> int | None:
    """The BOS id where the tokenizer puts one before a prompt, else None."""
    with_special = tokenizer.encode("a", add_special_tokens=True)
    without = tokenizer.encode("a", add_special_tokens=False)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and len(with_special) > len(without) and with_special[0] == bos:
        return int(bos)
    return None


def file_level_ids(fim: FimTokens, prefix: Sequence[int], suffix: Sequence[int],
                   bos: int | None = None) -> list[int]:
    """`[PRE] prefix [SUF] suffix [MID]`: the file-level layout of the code models' cards (and
    of Ollama's templates for them), for `suffix` on /v1/completions and Ollama's generate."""
    assert fim.prefix is not None and fim.suffix is not None and fim.middle is not None
    return [*([] if bos is None else [bos]), fim.prefix, *prefix, fim.suffix, *suffix,
            fim.middle]


def fim_refusal(fim: FimTokens, model: str) -> str | None:
    """Why `model` cannot fill in the middle (None: it can)."""
    if not fim.missing():
        return None
    return (f"{model} cannot fill in the middle: its vocabulary has no "
            f"{', '.join(fim.missing())} token (a code model's has them)")
