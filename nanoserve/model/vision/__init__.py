"""Image input: each model family's preprocessing (numpy and Pillow only, for the API process)
and its vision tower (torch, for the engine). Importing this package imports neither."""
