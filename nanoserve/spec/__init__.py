"""Model-free draft proposers for speculative decoding: prompt lookup (`ngram.py`) and a
frequency-scored suffix match (`suffix.py`). Numpy and Python only; the engine asks them for a
request's next tokens (engine/drafts.py) and keeps a draft only where the model draws it."""
