"""The chat page at `/` (localllm/server/chat_page.py, webui/): served from the package, under the server's Host, Origin
and API-key rules, and driven in a real headless Chromium (Debian's, which .ci/run installs; Playwright's Python
package drives it, its own browser downloads never used): a question typed, the answer streamed onto the page,
stop, regenerate, the conversation kept across a reload.

The screenshot is saved in the test's tmp dir, and also as tests/artifacts/chat-page.png when LOCALLLM_ARTIFACTS=1
(CI sets CI=true, which does the same)."""

from __future__ import annotations

import os
import shutil
import time
from importlib import resources
from pathlib import Path

import httpx
import pytest

from conftest import model_file
from test_server import KEY, start_server, stop_server

MODEL = "smollm2-135m-instruct"
CHROMIUM = os.environ.get("LOCALLLM_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).parent / "artifacts"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def server():
    model_file(MODEL)
    proc, url = start_server(MODEL, "--parallel", "2", "--max-tokens", "1024", api_key=KEY)
    yield url
    err = stop_server(proc)
    assert "Traceback" not in err, err


def test_the_page_ships_in_the_package():
    for name in ("index.html", "app.js", "app.css"):
        assert resources.files("localllm.server").joinpath("webui", name).is_file()


def test_a_browser_gets_the_page_and_other_clients_ollamas_answer(server):
    page = httpx.get(server + "/", headers={"Accept": "text/html,*/*"})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/ui/app.js" in page.text and "http" not in page.text.split("<body>")[0].replace("http-equiv", "")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp  # nothing leaves the machine
    # the page and its files hold no secret: open without the key; the API is not
    assert httpx.get(server + "/ui/app.js").status_code == 200
    assert httpx.get(server + "/ui/app.css").headers["content-type"].startswith("text/css")
    assert httpx.get(server + "/ui/secret.txt").status_code == 404
    assert httpx.get(server + "/ui/../v1/models").status_code in (401, 404)
    assert httpx.get(server + "/").status_code == 401  # Ollama's probe, without HTML: the API's rules
    assert httpx.get(server + "/", headers={"Authorization": f"Bearer {KEY}"}).text.startswith("Ollama is running")
    assert httpx.get(server + "/v1/models").status_code == 401
    # Host rules hold for the page too (DNS rebinding)
    assert httpx.get(server + "/", headers={"Accept": "text/html", "Host": "evil.example"}).status_code == 403


def chromium_or_skip():
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium")
        pytest.skip(f"{CHROMIUM} is missing (Debian's chromium package; .ci/run installs it)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    return sync_playwright


def until(page, expression: str, timeout: float, what: str):
    """Poll a page expression from here: the page's Content-Security-Policy forbids the eval that Playwright's
    wait_for_function uses in the page (page.evaluate goes through the DevTools protocol, which CSP does not see)."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


STREAMING = "(document.querySelector('.msg.assistant.streaming') || {textContent: ''}).textContent.length"


def test_chat_in_a_real_browser(server, tmp_path):
    sync_playwright = chromium_or_skip()
    shot = tmp_path / "chat-page.png"
    with sync_playwright() as p:
        # a profile of its own in a tmp dir (Playwright's launch makes one; it refuses --user-data-dir in args)
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            context = browser.new_context(viewport={"width": 1100, "height": 760})
            page = context.new_page()
            outside = []
            page.on("request", lambda r: outside.append(r.url) if not r.url.startswith(server) else None)
            page.goto(server + "/")
            page.wait_for_selector("#status.error", timeout=15000)  # no key yet: the model list says so
            assert "API key" in page.inner_text("#status")
            page.click("#settings-toggle")
            page.fill("#api_key", KEY)
            page.dispatch_event("#api_key", "change")
            until(page, "document.querySelector('#model').options.length > 0", 15, "the model list")
            assert page.input_value("#model") == MODEL
            page.fill("#max_tokens", "1000")
            page.dispatch_event("#max_tokens", "change")
            page.click("#settings-toggle")

            # a question typed; the answer streams onto the page; stop ends it
            page.fill("#input", "Write a long story about a dragon who learns to bake bread.")
            page.press("#input", "Enter")
            page.wait_for_selector(".msg.user", timeout=5000)
            answer = page.locator(".msg.assistant").last
            until(page, f"{STREAMING} > 40", 120, "the answer's first words")
            first = len(answer.inner_text())
            until(page, f"{STREAMING} > {first + 40}", 60, "more of the answer, streamed")
            assert page.is_visible("#stop") and not page.is_visible("#send")
            page.screenshot(path=str(shot))
            page.click("#stop")
            page.wait_for_selector("#send", state="visible", timeout=10000)
            assert "Stopped." in answer.inner_text() and not page.is_visible("#stop")
            kept = answer.inner_text()
            time.sleep(1.0)
            assert answer.inner_text() == kept  # stopped means nothing more arrives

            # regenerate replaces the answer; a short one runs to its end
            page.click("#settings-toggle")
            page.fill("#max_tokens", "24")
            page.dispatch_event("#max_tokens", "change")
            page.click("#regenerate")
            page.wait_for_selector(".msg.assistant.streaming", timeout=10000)
            page.wait_for_selector("#regenerate", state="visible", timeout=120000)
            assert page.locator(".msg.assistant").count() == 1
            assert "Stopped." not in page.locator(".msg.assistant").last.inner_text()

            # Markdown with highlighted code, and no HTML from the model
            html = page.evaluate("markdown('**bold** `x`\\n```python\\ndef f():\\n    return 1  # one\\n```\\n<img src=x>')")
            assert '<strong>bold</strong>' in html and '<span class="tok-kw">def</span>' in html
            assert '<span class="tok-com"># one</span>' in html and "<img" not in html and "&lt;img" in html

            # the page's loop guard: a line of prose the 4th time (the line being written does not count yet)
            assert page.evaluate("repeatedLine('A day to dream\\n'.repeat(4))")
            assert not page.evaluate("repeatedLine('A day to dream\\n'.repeat(3) + 'A day to dream')")
            assert not page.evaluate("repeatedLine('```\\n' + 'print(\\'hello world\\')\\n'.repeat(5))")
            assert page.evaluate("repeatedLine('```\\n' + 'print(\\'hello world\\')\\n'.repeat(8))")

            # the conversation is kept in the browser's storage across a reload; the theme toggles
            page.reload()
            page.wait_for_selector(".msg.user", timeout=10000)
            assert "dragon" in page.inner_text(".msg.user") and page.locator("#chats li").count() == 1
            page.click("#theme")
            assert page.evaluate("document.documentElement.dataset.theme") == "light"
            assert not outside, outside  # no request left for anywhere but this server
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    if os.environ.get("LOCALLLM_ARTIFACTS") or os.environ.get("CI") == "true":
        ARTIFACTS.mkdir(exist_ok=True)
        shutil.copy(shot, ARTIFACTS / shot.name)
