"""The built-in chat page and dashboard (router.py serves them; static/ holds the files)."""
