"""Structured outputs: the output must match a JSON schema, regex, choice or grammar.

`grammar.py` compiles grammars (llguidance) on a worker thread and gives each sequence a
matcher; `bitmask.py` turns the matchers' allowed tokens into -inf on the logits;
`manager.py` is what the engine core holds: one `SequenceGrammar` per request, and the step's
fill-and-apply on the constrained rows, right before the sampler.
"""
