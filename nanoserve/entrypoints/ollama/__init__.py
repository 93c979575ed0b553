"""Ollama's API (`/api/*`) on the server's app: a translator into the neutral chat input."""
