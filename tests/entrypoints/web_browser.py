"""A real headless Chromium for the web UI's tests: Playwright for Python driving Debian's
`chromium` package (`/usr/bin/chromium`, which `make test` installs when it is missing).
Playwright's own browser download is never used.

Also the screenshot helper: a page's PNG under the test's temporary directory when the test
fails, and the README's pictures of the chat page and the dashboard (run this file against a
running server: `python tests/entrypoints/web_browser.py http://127.0.0.1:8000 docs/`).
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

CHROMIUM = Path("/usr/bin/chromium")


def chromium() -> Iterator[Browser]:
    """One headless browser (a module-scoped fixture yields from this), closed afterwards."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install chromium)")
    playwright = sync_playwright().start()
    try:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
        yield browser
        browser.close()
    finally:
        playwright.stop()


@dataclass
class WatchedPage:
    """A page in a fresh browser context (its own localStorage), with what it did recorded from
    the first request on: console errors, uncaught exceptions, requests, dialogs."""

    page: Page
    origin: str
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    def foreign_requests(self) -> list[str]:
        """Requests to anything but the server under test."""
        return [url for url in self.requests if not url.startswith(self.origin + "/")]


@contextmanager
def watched_page(browser: Browser, origin: str, request: pytest.FixtureRequest,
                 screenshot_dir: Path, **context_options: object) -> Iterator[WatchedPage]:
    """A WatchedPage; if the test fails, a full-page screenshot goes to `screenshot_dir`."""
    context = browser.new_context(**context_options)  # type: ignore[arg-type]
    page = context.new_page()
    watched = WatchedPage(page, origin)
    page.on("console", lambda m: watched.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda error: watched.errors.append(f"uncaught: {error}"))
    page.on("request", lambda r: watched.requests.append(r.url))

    def on_dialog(dialog: object) -> None:  # alert(), confirm(): what injected script would do
        watched.dialogs.append(getattr(dialog, "message", ""))
        dialog.dismiss()  # type: ignore[attr-defined]

    page.on("dialog", on_dialog)
    try:
        yield watched
    finally:
        if any(getattr(request.node, f"rep_{when}", None) is not None
               and getattr(request.node, f"rep_{when}").failed for when in ("setup", "call")):
            path = screenshot(page, screenshot_dir / "failure.png")
            print(f"screenshot of the failed test's page: {path}")
        context.close()


def screenshot(page: Page, path: Path) -> Path:
    """The whole page as a PNG at `path` (its directory is made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=True)
    return path


def docs_screenshots(url: str, out_dir: Path) -> None:
    """The README's pictures: the chat page after an answer, then the dashboard after 40 s of
    two clients asking for stories. Needs a server running at `url`, without an API key."""
    for browser in chromium():  # one pass: the generator closes the browser after it
        chat = browser.new_page(viewport={"width": 1280, "height": 760})
        chat.goto(url + "/")
        chat.wait_for_selector("body[data-ready=true]")
        chat.fill("#seed", "2")  # seeded answers: the same picture each time
        chat.fill("#max_tokens", "160")
        for question in ("What is the capital of France?",
                         "Write a Python function that returns it."):
            chat.fill("#input", question)
            chat.press("#input", "Enter")
            chat.wait_for_selector("article.assistant:last-child:not([data-state=streaming])",
                                   timeout=120_000)
        screenshot(chat, out_dir / "chat-page.png")
        dashboard = browser.new_page(viewport={"width": 1280, "height": 480})
        dashboard.goto(url + "/dashboard")
        stop = threading.Event()
        clients = [threading.Thread(target=_ask_for_stories, args=(url, stop, k))
                   for k in range(2)]
        for client in clients:
            client.start()
        dashboard.wait_for_timeout(40_000)
        screenshot(dashboard, out_dir / "dashboard.png")
        stop.set()
        for client in clients:
            client.join()


def _ask_for_stories(url: str, stop: threading.Event, k: int) -> None:
    """One client's requests, one after another (their shared prefix hits the prefix cache)."""
    for i in itertools.count():
        if stop.is_set():
            return
        httpx.post(url + "/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": f"Tell me a story about the Seine ({k}, "
                                                     f"{i})."}],
            "max_tokens": 200, "ignore_eos": True})


if __name__ == "__main__":
    docs_screenshots(sys.argv[1].rstrip("/"), Path(sys.argv[2]))


# The browser tests' fixtures: a module imports `browser` and `web` and defines `server`.
@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    yield from chromium()


@pytest.fixture
def web(browser: Browser, server: Any, request: pytest.FixtureRequest,
        tmp_path: Path) -> Iterator[WatchedPage]:
    """A page on `server`'s origin, watched (console errors, other hosts; failure.png)."""
    with watched_page(browser, server.url, request, tmp_path) as watched:
        yield watched
