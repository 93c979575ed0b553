"""The chat page and the dashboard in a real headless Chromium against a server with an API key,
a reasoning parser and suffix speculation (one server for all, since starting one costs
seconds): the key flow, the reasoning block, the dashboard's live tokens/s and draft acceptance,
and the URL `nanoserve serve` prints."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect
from server_harness import API_KEY, RunningServer
from web_browser import WatchedPage, browser, web  # noqa: F401 (fixtures)

MODEL = "tiny-reasoning"
STORE_KEY = f"localStorage.setItem('nanoserve.apiKey', '{API_KEY}')"


@pytest.fixture(scope="module")
def server(tiny_reasoning_model_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("keyed-server") / "server.log"
    server = RunningServer(str(tiny_reasoning_model_dir), "--reasoning-parser", "qwen3",
                          "--served-model-name", MODEL, "--speculative-config",
                          '{"method": "suffix"}', api_key=API_KEY, log=log_path)
    yield server
    assert server.stop() == 0


def enter_key(page: Page, key: str) -> None:
    expect(page.locator("#key-dialog")).to_be_visible()
    page.fill("#key-dialog input", key)
    page.click("#key-dialog button[type=submit]")


def test_api_key_is_asked_for_kept_and_sent(web: WatchedPage) -> None:
    page = web.page
    page.goto(web.origin + "/")  # the page itself is public
    expect(page.locator("#key-dialog .key-reason")).to_have_text("This server needs an API key.")
    enter_key(page, "not-the-key")
    expect(page.locator("#key-dialog .key-reason")).to_contain_text("did not accept")
    enter_key(page, API_KEY)
    page.wait_for_selector("body[data-ready=true]")
    expect(page.locator("#model-name")).to_have_text(MODEL)
    assert page.evaluate("localStorage.getItem('nanoserve.apiKey')") == API_KEY
    page.fill("#max_tokens", "8")
    page.fill("#input", "Hello")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.press("#input", "Enter")
    assert sent.value.all_headers()["authorization"] == f"Bearer {API_KEY}"
    expect(page.locator("article.assistant")).to_have_attribute("data-state", "done")
    page.reload()  # kept: no question the second time, on either page
    page.wait_for_selector("body[data-ready=true]")
    page.goto(web.origin + "/dashboard")
    expect(page.locator("#status")).to_contain_text("updated")
    expect(page.locator("#key-dialog")).to_have_count(0)


def test_dashboard_without_a_key_asks_and_waits(web: WatchedPage) -> None:
    page = web.page
    page.goto(web.origin + "/dashboard")
    expect(page.locator("#key-dialog")).to_be_visible()
    page.click("#key-dialog button[type=button]")  # cancel
    expect(page.locator("#status")).to_contain_text("needs an API key")
    page.click("#status button")
    enter_key(page, API_KEY)
    expect(page.locator("#status")).to_contain_text("updated")


def test_reasoning_shows_in_its_collapsed_block(web: WatchedPage, server: RunningServer) -> None:
    page = web.page
    page.add_init_script(STORE_KEY)
    page.goto(web.origin + "/")
    page.wait_for_selector("body[data-ready=true]")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "24")
    page.fill("#input", "Why is the sky blue?")
    page.press("#input", "Enter")
    answer = page.locator("article.assistant")
    expect(answer).to_have_attribute("data-state", "done")
    expected = server.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Why is the sky blue?"}],
        "temperature": 0, "max_tokens": 24}).json()["choices"][0]["message"]
    block = answer.locator("details.reasoning")
    expect(block).to_be_visible()
    assert block.evaluate("details => details.open") is False  # collapsed until asked
    assert expected["reasoning"]  # the template opens <think>: the model's text is reasoning
    assert block.locator(".reasoning-text").text_content() == expected["reasoning"]
    assert (answer.locator(".content").text_content() or "").strip() == (
        expected["content"] or "").strip()
    block.locator("summary").click()
    expect(block.locator(".reasoning-text")).to_be_visible()
    assert web.errors == []


def test_dashboard_shows_tokens_per_second_while_a_request_runs(
        web: WatchedPage, server: RunningServer) -> None:
    page = web.page
    page.add_init_script(STORE_KEY)
    page.goto(web.origin + "/dashboard?interval=0.2")  # the request may take only a second
    expect(page.locator("#status")).to_contain_text("updated")
    finished_before = server.metric("nanoserve:request_success_total")
    answers: list[httpx.Response] = []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Go on and on."}],
            "max_tokens": 900, "ignore_eos": True,  # seconds of tokens on the tiny model
            "temperature": 0.0}  # greedy: the random model falls into a loop, drafts follow
    worker = threading.Thread(
        target=lambda: answers.append(server.post("/v1/chat/completions", body)))
    worker.start()
    try:
        # both figures from one scrape: tokens/s above 0 while the request is running
        page.wait_for_function("""() => {
            const value = (id) => Number(document.querySelector(`#${id} .value`).dataset.value);
            return value('tokens') > 0 && value('requests') >= 1;
        }""", timeout=30_000)
        # ...and before it finished: the tokens are counted as they come, not at the end
        assert server.metric("nanoserve:request_success_total") == finished_before
        expect(page.locator("#tokens .value")).to_contain_text("tok/s")
        expect(page.locator("#tokens svg polyline")).to_have_count(1)  # plotted too
        # the tiny model's endless answer repeats itself: drafts are made and kept
        page.wait_for_function(
            "() => Number(document.querySelector('#acceptance .value').dataset.value) > 0",
            timeout=30_000)
        expect(page.locator("#acceptance .value")).to_contain_text("% kept")
    finally:
        worker.join()
    assert answers[0].status_code == 200, answers[0].text
    assert web.errors == [] and web.foreign_requests() == []


def test_serve_prints_the_page_url_when_ready(server: RunningServer) -> None:
    log = server.log_path.read_text()
    assert f"Chat with {MODEL} at {server.url}/ (dashboard: {server.url}/dashboard)" in log
    assert httpx.get(server.url + "/").status_code == 200  # public, while the API is keyed
    assert httpx.get(server.url + "/v1/models").status_code == 401
