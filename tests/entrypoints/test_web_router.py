"""The web UI's routes in the app, without a browser or an engine: which paths are public, what
`--no-web-ui` removes, the headers the pages carry, and that the files ship with the package.
(The pages themselves run in a real browser in test_web_chat.py and test_web_keyed.py.)"""

from __future__ import annotations

import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from nanoserve.entrypoints.app import build_app
from nanoserve.entrypoints.web import router
from nanoserve.entrypoints.web.router import ASSETS, PAGES, STATIC_URL, page_banner
from nanoserve.server_config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
WEB_FILES = [*PAGES.values(), *ASSETS, "vendor/LICENSE.marked", "vendor/LICENSE.dompurify",
             "vendor/README.md"]


def client(generation_defaults: dict[str, Any] | None = None, **config: Any) -> TestClient:
    # the routes read only these fields of the server's context until a request is generated
    ctx = SimpleNamespace(model_name="tiny", max_model_len=1024, reasoning_parser="qwen3",
                          generation_defaults=generation_defaults or {})
    return TestClient(build_app(ctx, ServerConfig(**config)))


def test_with_a_key_the_pages_are_public_and_every_call_is_keyed() -> None:
    web = client(api_keys=("secret",))
    for path in [*PAGES, *(STATIC_URL + name for name in ASSETS)]:
        assert web.get(path).status_code == 200, path
    for path in ("/web/defaults", "/metrics", "/v1/models", STATIC_URL + "no-such.js"):
        assert web.get(path).status_code == 401, path
    keyed = web.get("/web/defaults", headers={"Authorization": "Bearer secret"})
    assert keyed.status_code == 200
    assert keyed.json()["model"] == "tiny" and keyed.json()["reasoning"] is True


def test_no_web_ui_serves_neither_page() -> None:
    web = client(web_ui=False, api_keys=("secret",))
    for path in ("/", "/dashboard", STATIC_URL + "chat.js", "/web/defaults"):
        # not public any more: without the key, 401; with it, no such page
        assert web.get(path).status_code == 401, path
    for path in ("/", "/dashboard", STATIC_URL + "chat.js"):
        assert web.get(path, headers={"Authorization": "Bearer secret"}).status_code == 404
    assert client(web_ui=False).get("/").status_code == 404
    # the model's settings stay (keyed): behind --models-dir the router's page reads them
    keyed = web.get("/web/defaults", headers={"Authorization": "Bearer secret"})
    assert keyed.status_code == 200 and keyed.json()["model"] == "tiny"


def test_pages_forbid_inline_script_and_other_hosts() -> None:
    page = client().get("/")
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    policy = page.headers["content-security-policy"]
    assert "script-src 'self';" in policy and "connect-src 'self';" in policy
    assert "default-src 'none'" in policy and "unsafe" not in policy
    script = client().get(STATIC_URL + "chat.js")
    assert script.headers["content-type"].startswith("text/javascript")
    assert script.headers["x-content-type-options"] == "nosniff"


def test_unknown_static_path_is_a_404_not_a_file_read() -> None:
    web = client()
    assert web.get(STATIC_URL + "no-such.js").status_code == 404
    assert web.get(STATIC_URL + "%2e%2e/router.py").status_code == 404


def test_web_ui_routes_stay_out_of_the_openapi_schema() -> None:
    paths = client().get("/openapi.json").json()["paths"]
    assert "/" not in paths and "/web/defaults" not in paths and "/v1/chat/completions" in paths


@pytest.mark.parametrize(("generation_config", "source", "temperature"), [
    ({}, "preset", 0.7), ({"temperature": 0.6, "top_p": 0.9}, "model", 0.6)])
def test_defaults_come_from_the_model_else_the_preset(generation_config: dict[str, Any],
                                                      source: str, temperature: float) -> None:
    body = client(generation_config).get("/web/defaults").json()
    assert body["source"] == source and body["sampling"]["temperature"] == temperature
    assert body["sampling"]["max_tokens"] <= 1024 // 2


def test_web_files_ship_as_package_data() -> None:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["nanoserve"]
    package = Path(router.__file__).parents[2]
    shipped = {path for pattern in patterns for path in package.glob(pattern)}
    for name in WEB_FILES:
        assert package / "entrypoints/web/static" / name in shipped, f"{name} not in package-data"


def test_banner_names_a_url_a_browser_can_open() -> None:
    assert page_banner("0.0.0.0", 8000, "m") == (
        "Chat with m at http://localhost:8000/ (dashboard: http://localhost:8000/dashboard)")
    assert "http://[::1]:81/" in page_banner("::1", 81, "m")
    assert "http://127.0.0.1:8000/" in page_banner("127.0.0.1", 8000, "m")
