"""The chat page with images, in a real headless Chromium (Playwright, Debian's chromium) against
the real server on the tiny Gemma 3 vision model: an image picked or pasted shows as a thumbnail
until sent, goes to /v1/chat/completions as an `image_url` part holding the file's own bytes,
shows in the user turn, stays in the history of later turns and in the stored conversation; the
server's refusal of a bad image shows in the transcript. That the button is hidden for a
text-only model is test_web_chat.py's (its server serves one)."""

from __future__ import annotations

import base64
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from playwright.sync_api import Locator, Page, expect
from server_harness import RunningServer
from web_browser import WatchedPage, browser, web  # noqa: F401 (fixtures)

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))

MODEL = "tiny-vlm"
# a synthetic paste through the page's own handler: headless Chromium's clipboard holds text
# only, so the image is a File in a DataTransfer, as the browser builds one from a real paste
PASTE_IMAGE = """async ([b64, name]) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const data = new DataTransfer();
  data.items.add(new File([bytes], name, {type: 'image/png'}));
  const event = new ClipboardEvent('paste', {clipboardData: data, bubbles: true,
                                             cancelable: true});
  document.getElementById('input').dispatchEvent(event);
}"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory,
           default_tokenizer: Any) -> Iterator[RunningServer]:
    from vision_checkpoints import write_tiny_gemma3_vlm

    model_dir = write_tiny_gemma3_vlm(tmp_path_factory.mktemp("tiny-gemma3-vlm"),
                                      default_tokenizer)
    server = RunningServer(str(model_dir), "--served-model-name", MODEL)
    yield server
    assert server.stop() == 0


def png(path: Path, color: tuple[int, int, int]) -> Path:
    """A small PNG of one color at `path`."""
    Image.new("RGB", (16, 12), color).save(path, "PNG")
    return path


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def open_chat(web: WatchedPage) -> Page:
    page = web.page
    page.goto(web.origin + "/")
    page.wait_for_selector("body[data-ready=true]")
    page.fill("#max_tokens", "8")
    return page


def send(page: Page, text: str, state: str = "done") -> tuple[Locator, dict[str, Any]]:
    """Type `text`, press Enter, wait for the answer to reach `state`: the answer's element
    and the body the page sent."""
    page.fill("#input", text)
    with page.expect_request("**/v1/chat/completions") as sent:
        page.press("#input", "Enter")
    answer = page.locator("#messages article.assistant").last
    expect(answer).to_have_attribute("data-state", state, timeout=60_000)
    body = sent.value.post_data_json
    assert isinstance(body, dict)
    return answer, body


def image_urls(message: dict[str, Any]) -> list[str]:
    content = message["content"]
    return [] if isinstance(content, str) else [
        part["image_url"]["url"] for part in content if part["type"] == "image_url"]


def test_picked_image_is_sent_shown_and_kept_in_the_history(web: WatchedPage,
                                                           tmp_path: Path) -> None:
    page = open_chat(web)
    expect(page.locator("#attach")).to_be_visible()  # /api/show lists "vision"
    red = png(tmp_path / "red.png", (200, 30, 30))
    page.set_input_files("#image-file", str(red))
    thumbs = page.locator("#attachments img")
    expect(thumbs).to_have_count(1)
    expect(thumbs).to_be_visible()
    answer, body = send(page, "What color is this?")
    assert body["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "What color is this?"},
        {"type": "image_url", "image_url": {"url": data_url(red)}}]}]  # the file's own bytes
    expect(page.locator("#attachments")).to_be_hidden()  # handed to the message
    turn = page.locator("#messages article.user")
    expect(turn.locator("img.thumb")).to_have_attribute("src", data_url(red))
    expect(turn.locator("img.thumb")).to_be_visible()
    expect(turn.locator(".content")).to_have_text("What color is this?")
    assert (answer.locator(".content").text_content() or "").strip()  # the model answered
    _, body = send(page, "And now?")  # text only: the first turn's image goes again
    assert [image_urls(m) for m in body["messages"]] == [[data_url(red)], [], []]
    assert body["messages"][-1] == {"role": "user", "content": "And now?"}
    page.reload()  # kept with the conversation
    page.wait_for_selector("body[data-ready=true]")
    expect(page.locator("#messages article.user").first.locator("img.thumb")).to_have_attribute(
        "src", data_url(red))
    assert web.errors == [] and web.foreign_requests() == []


def test_pasted_images_can_be_removed_before_sending(web: WatchedPage, tmp_path: Path) -> None:
    page = open_chat(web)
    blue, green = png(tmp_path / "blue.png", (20, 40, 220)), png(tmp_path / "g.png", (0, 160, 0))
    for image in (blue, green):
        page.evaluate(PASTE_IMAGE, [base64.b64encode(image.read_bytes()).decode(), image.name])
    expect(page.locator("#attachments img")).to_have_count(2)
    assert page.input_value("#input") == ""  # an image pastes no text
    page.get_by_role("button", name="Remove image 1").click()
    expect(page.locator("#attachments img")).to_have_count(1)
    answer, body = send(page, "")  # an image alone is a message
    assert body["messages"][0]["content"] == [
        {"type": "image_url", "image_url": {"url": data_url(green)}}]
    expect(page.locator("#messages article.user img.thumb")).to_have_count(1)
    assert (answer.locator(".content").text_content() or "").strip()
    expect(page.locator("#conversations li.current .open")).to_have_text("Image")
    assert web.errors == []


def test_the_servers_refusal_of_a_bad_image_shows_in_the_turn(web: WatchedPage,
                                                             tmp_path: Path) -> None:
    page = open_chat(web)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\nnot really a picture")
    page.set_input_files("#image-file", str(broken))
    answer, _ = send(page, "What is this?", state="error")
    expect(answer.locator(".error")).to_contain_text(  # the server's words, naming the part
        "messages.0.content.1 could not be decoded as an image")


def test_no_answer_about_images_hides_the_button(web: WatchedPage) -> None:
    web.page.route("**/api/show", lambda route: route.abort())  # the server unreachable
    page = open_chat(web)
    expect(page.locator("#attach")).to_be_hidden()
