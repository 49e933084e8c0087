"""The chat page (runtime/webui.py, runtime/static) in a real browser: Debian's headless Chromium driven by
Playwright's Python API (executable_path=/usr/bin/chromium; Playwright's own browser builds are never used).
.ci/run installs both (apt-get chromium, pip's dev extra); a machine without them fails here naming the
missing piece. Screenshots go to tests/artifacts/ (git-ignored); docs/chat-page.png is the README's."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from server_helpers import metric, running_server

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = os.environ.get("UACOMPILE_CHROMIUM", "/usr/bin/chromium")


def _playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the browser tests need Playwright's Python API: pip install -e '.[dev]' (playwright); "
                    "no browser download is needed", pytrace=False)
    if not (Path(CHROMIUM).is_file() or shutil.which(CHROMIUM)):
        pytest.fail(f"the browser tests need Debian's Chromium at {CHROMIUM}: apt-get install -y chromium "
                    "(or set UACOMPILE_CHROMIUM to another Chromium binary)", pytrace=False)
    return sync_playwright


@pytest.fixture(scope="module")
def browser():
    sync_playwright = _playwright()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                              args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1100, "height": 640})
    pg = ctx.new_page()
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    try:
        yield pg
    finally:
        ctx.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def shot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path))
    return path


def _send(page, conv: int, text: str) -> None:
    box = page.locator(f'.conv[data-conv="{conv}"] .prompt')
    box.fill(text)
    box.press("Enter")


def _answer(page, conv: int):
    return page.locator(f'.conv[data-conv="{conv}"] .msg.assistant').last


def test_page_loads_with_the_model_and_its_context():
    with running_server() as (url, _):
        r = httpx.get(url + "/", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        for asset in ("/static/app.js", "/static/style.css"):
            assert httpx.get(url + asset, timeout=10).status_code == 200, asset
        assert "http://" not in r.text and "https://" not in r.text  # nothing from another host


def test_a_message_streams_into_two_conversations_at_once(page):
    with running_server(max_num_seqs=4) as (url, _):
        page.goto(url + "/")
        page.locator("#model").filter(has_text="stories260K").wait_for(timeout=10_000)
        assert "context: " in page.locator("#context").inner_text()
        page.locator("#max_tokens").fill("200")
        page.locator("#temperature").fill("0")
        # a poller in the page notes a moment when both answers have text while both are still streaming
        page.evaluate("""() => { window.overlap = false; const t = setInterval(() => {
            const live = [1, 2].every(i => {
              const c = document.querySelector(`.conv[data-conv="${i}"]`);
              const m = c.querySelector('.msg.assistant:last-child .text');
              return c.classList.contains('busy') && m && m.textContent.length > 0; });
            if (live) { window.overlap = true; clearInterval(t); } }, 2); }""")
        page.locator('.conv[data-conv="1"] .prompt').fill("Once upon a time")
        page.locator('.conv[data-conv="2"] .prompt').fill("Tom found a box")
        page.evaluate("() => [1, 2].forEach(i => document.querySelector(`.conv[data-conv='${i}'] .send`).click())")
        for i in (1, 2):
            page.locator(f'.conv[data-conv="{i}"] .send:enabled').wait_for(timeout=60_000)
            stats = _answer(page, i).locator(".stats").inner_text()
            assert "TTFT" in stats and "tok/s" in stats and "tokens" in stats, stats
        assert page.evaluate("window.overlap"), "the two answers never streamed at the same time"
        assert len(_answer(page, 1).locator(".text").inner_text()) > 20
        shot(page, "chat-two-conversations.png")
        if os.environ.get("UACOMPILE_UPDATE_DOCS_SCREENSHOT"):
            page.screenshot(path=str(ROOT / "docs" / "chat-page.png"))


def test_stop_aborts_the_request_and_frees_its_pages(page):
    with running_server() as (url, _):
        page.goto(url + "/")
        page.locator("#model").filter(has_text="stories260K").wait_for(timeout=10_000)
        page.locator("#max_tokens").fill("")  # no cap: it would run until the context is full
        page.locator("#temperature").fill("0")
        _send(page, 1, "Once upon a time")
        page.locator('.conv[data-conv="1"] .msg.assistant .text').filter(has_text="a").wait_for(timeout=30_000)
        assert metric(url, "vllm:num_requests_running", model_name="stories260K") == 1
        page.locator('.conv[data-conv="1"] .stop').click()
        _answer(page, 1).locator(".stats").filter(has_text="stopped").wait_for(timeout=10_000)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if (metric(url, "vllm:num_requests_running", model_name="stories260K") == 0
                    and metric(url, "uacompile:kv_pages_in_use", model_name="stories260K") == 0):
                break
            time.sleep(0.05)
        assert metric(url, "vllm:num_requests_running", model_name="stories260K") == 0
        assert metric(url, "uacompile:kv_pages_in_use", model_name="stories260K") == 0
        assert metric(url, "uacompile:requests_aborted_total", model_name="stories260K") >= 1
        assert page.locator('.conv[data-conv="1"] .send').is_enabled()
        shot(page, "chat-stopped.png")


def test_an_api_key_server_asks_for_the_key_once(page):
    with running_server(api_key="sesame") as (url, _):
        page.goto(url + "/")
        dialog = page.locator("#key-dialog")
        dialog.wait_for(state="visible", timeout=10_000)
        shot(page, "chat-api-key.png")
        page.locator("#key-input").fill("sesame")
        page.locator("#key-ok").click()
        page.locator("#model").filter(has_text="stories260K").wait_for(timeout=10_000)
        page.locator("#max_tokens").fill("16")
        _send(page, 1, "Once upon a time")
        _answer(page, 1).locator(".stats").filter(has_text="tokens").wait_for(timeout=30_000)
        page.locator('.conv[data-conv="1"] .send:enabled').wait_for(timeout=30_000)
        assert not dialog.is_visible()
        assert page.locator(".msg.error").count() == 0


def test_a_refused_request_is_shown_as_an_error_message(page):
    with running_server() as (url, _):
        page.goto(url + "/")
        page.locator("#model").filter(has_text="stories260K").wait_for(timeout=10_000)
        page.locator("#temperature").fill("-1")
        _send(page, 1, "Once upon a time")
        err = page.locator('.conv[data-conv="1"] .msg.error')
        err.wait_for(timeout=10_000)
        assert err.inner_text().startswith("400: ") and "temperature" in err.inner_text()
        shot(page, "chat-error.png")
