"""The chat page in a real headless Chromium (Playwright, Debian's chromium) against the real
server on the tiny model: it loads clean, streams, shows a long prompt's progress, stops,
renders hostile text as text, keeps conversations, shows errors. Each test saves a screenshot
under its tmp_path when it fails."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Locator, Page, Route, expect
from server_harness import RunningServer, wait_until
from web_browser import WatchedPage, browser, watched_page, web  # noqa: F401 (fixtures)

MODEL = "tiny"
# each render of the last answer while it streams, as its text and state (a MutationObserver)
RECORD_RENDERS = """() => {
  window.renders = [];
  new MutationObserver(() => {
    const answer = [...document.querySelectorAll('#messages article.assistant')].at(-1);
    if (!answer) return;
    const render = {text: answer.querySelector('.content').textContent,
                    state: answer.dataset.state};
    const last = window.renders.at(-1);
    if (!last || last.text !== render.text || last.state !== render.state) {
      window.renders.push(render);
    }
  }).observe(document.getElementById('messages'),
             {childList: true, subtree: true, characterData: true, attributes: true});
}"""


@pytest.fixture(scope="module")
def server(tiny_model_dir: Any) -> Iterator[RunningServer]:
    server = RunningServer(str(tiny_model_dir("llama")), "--served-model-name", MODEL)
    yield server
    assert server.stop() == 0


def open_chat(web: WatchedPage, **settings: object) -> Page:
    """The chat page, its defaults loaded, with `settings` typed into the settings panel."""
    page = web.page
    page.goto(web.origin + "/")
    page.wait_for_selector("body[data-ready=true]")
    for name, value in settings.items():
        page.fill(f"#{name}", str(value))
    return page


def send(page: Page, text: str, state: str = "done") -> Locator:
    """Type `text`, press Enter, wait for the answer to reach `state`; the answer's element."""
    page.fill("#input", text)
    page.press("#input", "Enter")
    answer = page.locator("#messages article.assistant").last
    if state != "streaming":
        expect(answer).to_have_attribute("data-state", state, timeout=60_000)
    return answer


def api_answer(server: RunningServer, text: str, **params: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], **params}
    message: dict[str, Any] = server.post("/v1/chat/completions", body).json()["choices"][0][
        "message"]
    return message


def raw_text(answer: Locator) -> str:
    """The answer's text as the page holds it (its "Raw" view: the Markdown source)."""
    answer.locator(".raw-toggle").click()
    text = answer.locator("pre.raw").text_content() or ""
    answer.locator(".raw-toggle").click()
    return text


def test_page_loads_without_console_errors_or_requests_elsewhere(web: WatchedPage) -> None:
    page = open_chat(web)
    expect(page.locator("#model-name")).to_have_text(MODEL)
    # the tiny model names no sampling settings: the page starts from the chat preset
    assert [page.input_value(f"#{name}") for name in ("temperature", "top_p", "min_p")] == [
        "0.7", "0.95", "0.05"]
    expect(page.locator("#defaults-source")).to_contain_text("preset")
    page.fill("#max_tokens", "16")
    send(page, "Hello!")
    page.goto(web.origin + "/dashboard")
    expect(page.locator("#status")).to_contain_text("updated")
    assert web.errors == []
    assert web.foreign_requests() == []
    assert any(url.endswith("/v1/chat/completions") for url in web.requests)
    assert any(url.endswith("/metrics") for url in web.requests)


def test_a_text_only_model_offers_no_image_button(web: WatchedPage) -> None:
    page = open_chat(web)  # ready only once /api/show has answered
    assert any(url.endswith("/api/show") for url in web.requests)
    expect(page.locator("#attach")).to_be_hidden()  # "vision" is not among its capabilities
    expect(page.locator("#attachments")).to_be_hidden()


def test_answer_streams_and_equals_the_api_answer(web: WatchedPage,
                                                  server: RunningServer) -> None:
    page = open_chat(web, temperature=0, max_tokens=200)  # long enough to see many frames
    page.evaluate(RECORD_RENDERS)
    answer = send(page, "Tell me about the sea.")
    renders = page.evaluate("window.renders")
    growing = {r["text"] for r in renders if r["state"] == "streaming" and r["text"]}
    assert len(growing) >= 3, renders  # drawn while it streamed, not once at the end
    assert renders[-1]["state"] == "done"
    expected = api_answer(server, "Tell me about the sea.", temperature=0, max_tokens=200)
    assert expected["content"] and raw_text(answer) == expected["content"]
    expect(answer.locator(".finish")).to_have_text("finish: length")
    expect(answer.locator(".tokens")).to_have_text("200 tokens")
    expect(answer.locator(".ttft")).to_contain_text("first token")
    expect(answer.locator(".tps")).to_contain_text("tok/s")


# /v1/chat/completions as a stream the test writes piece by piece (`window.feed(events)`, then
# `window.end()`), and the body the page sent (`window.sentBody`): a long prompt's progress
# shown for as long as the test likes, however fast the tiny model would compute it
SCRIPTED_STREAM = """() => {
  const realFetch = window.fetch;
  window.fetch = (url, options) => {
    if (!String(url).endsWith('/v1/chat/completions')) return realFetch(url, options);
    window.sentBody = JSON.parse(options.body);
    const encoder = new TextEncoder();
    const body = new ReadableStream({start(controller) {
      window.feed = (events) => events.forEach((event) => controller.enqueue(
        encoder.encode(`data: ${JSON.stringify(event)}\\n\\n`)));
      window.end = () => {
        controller.enqueue(encoder.encode('data: [DONE]\\n\\n'));
        controller.close();
      };
    }});
    return Promise.resolve(new Response(body, {
      status: 200, headers: {'Content-Type': 'text/event-stream'}}));
  };
}"""


def progress_event(processed: int, total: int) -> dict[str, Any]:
    """A progress chunk as the server sends it (llama-server's shape)."""
    return {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}],
            "prompt_progress": {"total": total, "cache": 0, "processed": processed,
                                "time_ms": processed // 10}}


def test_long_prompt_shows_its_progress_until_the_first_token(web: WatchedPage) -> None:
    page = open_chat(web)
    page.evaluate(SCRIPTED_STREAM)
    answer = send(page, "a long question", state="streaming")
    page.wait_for_function("window.feed !== undefined")
    assert page.evaluate("window.sentBody.return_progress") is True
    progress = answer.locator(".progress")
    expect(progress).to_be_hidden()
    for processed in (64, 128):
        page.evaluate("(events) => window.feed(events)", [progress_event(processed, 200)])
        expect(progress).to_have_text(f"processing prompt: {processed}/200")
        expect(progress).to_be_visible()
    page.evaluate("(events) => { window.feed(events); window.end(); }", [
        progress_event(200, 200),
        {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop"}]}])
    expect(answer).to_have_attribute("data-state", "done")
    expect(progress).to_be_hidden()
    assert raw_text(answer) == "Hi"
    stored = page.evaluate("localStorage.getItem('nanoserve.conversations')")
    assert "Hi" in stored and "progress" not in stored  # not kept with the conversation
    assert web.errors == []


def num_aborted(server: RunningServer) -> float:
    """Requests the server finished as aborted (nanoserve:request_success, reason abort)."""
    text = httpx.get(server.url + "/metrics", headers=server.headers, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("nanoserve:request_success_total{")
               and 'finished_reason="abort"' in line)


def test_stop_mid_stream_frees_the_request_on_the_server(web: WatchedPage,
                                                         server: RunningServer) -> None:
    page = open_chat(web, temperature=0, max_tokens=900)  # ~9 s of tokens on the tiny model
    before = num_aborted(server)
    answer = send(page, "Write a very long story.", state="streaming")
    wait_until(lambda: server.metric("nanoserve:num_requests_running") == 1, "the request to run")
    expect(answer.locator(".content")).not_to_be_empty()
    page.click("#stop")
    expect(answer).to_have_attribute("data-state", "stopped")
    wait_until(lambda: server.metric("nanoserve:num_requests_running") == 0,
               "the server to free the stopped request", timeout=15)
    assert num_aborted(server) == before + 1  # aborted, not run to its 900 tokens
    expect(answer.locator(".finish")).to_have_text("finish: stopped")
    expect(page.locator("#send")).to_be_visible()
    assert web.errors == []


HOSTILE = (
    'Hi <script>window.pwned = "script"</script> and '
    '<img src=x onerror="window.pwned = \'img\'"> and [click me](javascript:window.pwned=1) '
    'and ![pic](http://evil.example/track.png)\n\n'
    '<a href="javascript:window.pwned=2">raw link</a> <b onmouseover="window.pwned=3">b</b>\n\n'
    '```html\n<script>window.pwned = "code"</script>\n```\n')


def hostile_stream(route: Route) -> None:
    """A stream as the server would send it, whose text tries every way to run script."""
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    events += [{"choices": [{"index": 0, "delta": {"content": HOSTILE[i:i + 7]}}]}
               for i in range(0, len(HOSTILE), 7)]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)


def test_hostile_markdown_renders_as_text_and_runs_nothing(web: WatchedPage) -> None:
    page = open_chat(web)
    page.route("**/v1/chat/completions", hostile_stream)
    answer = send(page, "Say something dangerous.")
    content = answer.locator(".content")
    text = content.text_content() or ""
    assert '<script>window.pwned = "script"</script>' in text  # shown, as text
    assert "<img src=x onerror=" in text and "raw link" in text and "click me" in text
    for selector in ("script", "img", "[onerror]", "[onmouseover]", "iframe"):
        assert content.locator(selector).count() == 0, selector
    hrefs = content.locator("a").evaluate_all("links => links.map(a => a.href)")
    assert not any(href.lower().startswith("javascript:") for href in hrefs), hrefs
    content.get_by_text("click me").click()  # a sanitized link does nothing
    assert page.evaluate("window.pwned") is None
    assert web.dialogs == [] and web.errors == [] and web.foreign_requests() == []
    assert content.locator("pre .copy-code").count() == 1  # the code block kept its button


def test_conversations_are_kept_switched_deleted_and_regenerated(web: WatchedPage) -> None:
    page = open_chat(web, system="Be brief.", temperature=0, max_tokens=8, seed=5)
    with page.expect_request("**/v1/chat/completions") as sent:
        first = raw_text(send(page, "first question"))
    body = sent.value.post_data_json  # the settings panel, as the request's fields
    assert body is not None
    assert body["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "first question"}]
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"]) == (
        0, 0.95, 8, 5)
    page.click("#new-chat")
    send(page, "second question")
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    conversations = page.locator("#conversations li")
    expect(conversations).to_have_count(2)
    expect(page.locator("#messages article.user")).to_have_text("second question")
    assert page.input_value("#temperature") == "0"  # settings kept too
    page.locator("#conversations .open", has_text="first question").click()
    expect(page.locator("#messages article.user")).to_have_text("first question")
    page.locator("#messages .regenerate").click()  # greedy: the same answer, in its place
    answers = page.locator("#messages article.assistant")
    expect(answers.last).to_have_attribute("data-state", "done")
    expect(answers).to_have_count(1)
    assert raw_text(answers.last) == first
    conversations.filter(has_text="first question").locator(".delete").click()
    expect(conversations).to_have_count(1)
    page.reload()
    expect(page.locator("#conversations li")).to_have_count(1)
    expect(page.locator("#messages article.user")).to_have_text("second question")


def test_keyboard_and_errors(web: WatchedPage) -> None:
    page = open_chat(web, max_tokens=100000)
    page.fill("#input", "one line")
    page.press("#input", "Shift+Enter")
    page.keyboard.type("two lines")
    assert page.input_value("#input") == "one line\ntwo lines"  # Shift+Enter sent nothing
    expect(page.locator("#messages article")).to_have_count(0)
    answer = send(page, "too long", state="error")  # the server's 400, in the page
    expect(answer.locator(".error")).to_contain_text("max_tokens")
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=429, json={"error": {"message": "at capacity", "code": 429}}))
    page.locator("#messages .regenerate").click()
    answer = page.locator("#messages article.assistant").last
    expect(answer).to_have_attribute("data-state", "error")
    expect(answer.locator(".error")).to_contain_text("busy")


def test_narrow_dark_screen(browser: Browser, server: RunningServer,
                            request: pytest.FixtureRequest, tmp_path: Path) -> None:
    with watched_page(browser, server.url, request, tmp_path, color_scheme="dark",
                      viewport={"width": 390, "height": 800}) as web:
        page = open_chat(web)
        background = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert background == "rgb(21, 24, 28)"  # the dark palette, as the system asks
        expect(page.locator("#sidebar")).to_be_hidden()  # panels open from the top bar
        expect(page.locator("#settings")).to_be_hidden()
        page.click("#toggle-sidebar")
        expect(page.locator("#sidebar")).to_be_visible()
        page.click("#new-chat")  # choosing a conversation closes the panel
        expect(page.locator("#sidebar")).to_be_hidden()
        page.click("#toggle-settings")
        expect(page.locator("#temperature")).to_be_visible()
        assert web.errors == []
