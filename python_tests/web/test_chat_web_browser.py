"""The chat page in a real headless Chromium (the system's, driven by Playwright) against a real
chat_web process on 127.0.0.1: streamed text appears, turns complete with the model's own reply,
multi-turn history reaches the server, edit, regenerate, stop (which stops the server), a
validation error shown in the page, new chat, and nothing loaded from anywhere but the server.

The screenshot in docs/guide.md comes from here:
    NANOCHAT_FAST_SCREENSHOT=docs/chat_web.png pytest python_tests/web/test_chat_web_browser.py
"""

import os
import shutil
import time

import pytest

pytest.importorskip("fastapi", reason="chat_web needs the web extra: pip install -e '.[web]'")
import httpx  # noqa: E402
from support.chat_web_support import chat_home, chat_web_process, load_chat_model  # noqa: E402

from nanochat_fast.model import generation  # noqa: E402

pytestmark = pytest.mark.browser


def find_chromium() -> str | None:
    """NANOCHAT_FAST_CHROMIUM, else a Chromium on PATH (Debian's `chromium` package)."""
    for candidate in (
        os.environ.get("NANOCHAT_FAST_CHROMIUM"),
        shutil.which("chromium"),
        shutil.which("chromium-browser"),
        shutil.which("google-chrome"),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture(scope="module")
def playwright_api():
    return pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e '.[test]'")


@pytest.fixture(scope="module")
def browser(playwright_api):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium found: apt-get install chromium (or set NANOCHAT_FAST_CHROMIUM to its path)")
    playwright_api.expect.set_options(timeout=30_000)  # a loaded 2-core machine can be slow
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def web_home(tiny_home):
    return chat_home(tiny_home)


@pytest.fixture(scope="module")
def server(web_home):
    # 0.2 s per token: a reply takes seconds, long enough to press Stop midway on a busy machine
    with chat_web_process(web_home, ["--run=chat", "--temperature=0.8", "--top-k=40"], token_delay=0.2) as s:
        yield s


def streamed_text(page) -> str:
    """The reply's text once some has arrived while it is still streaming."""
    return page.wait_for_function(
        """() => {
        const t = document.querySelector('.message.assistant[data-state="streaming"] .text');
        return t && t.textContent ? t.textContent : null; }""",
        timeout=30_000,
    ).json_value()


def ask(page, text: str):
    page.fill("#input", text)
    page.press("#input", "Enter")


def wait_idle(url: str) -> dict:
    deadline = time.monotonic() + 30
    while (stats := httpx.get(url + "/stats").json())["replicas_busy"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)
    return stats


def test_chat_in_a_real_browser(browser, server, web_home, playwright_api, tmp_path):
    expect = playwright_api.expect
    model, tokenizer = load_chat_model(web_home)

    def reference(messages):  # the model's own greedy reply, computed here without the server
        return generation.assistant_reply(model, tokenizer, messages, 512, temperature=0.0)

    page = browser.new_page(viewport={"width": 900, "height": 620})
    urls, problems = [], []
    page.on("request", lambda r: urls.append(r.url))
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(server.url + "/")
    expect(page.locator("#model")).to_have_text("chat step 1 (mid)")  # filled in from /health
    expect(page.locator("#temperature")).to_have_value("0.8")
    expect(page.locator("#top-k")).to_have_value("40")
    page.fill("#temperature", "0")  # greedy: the replies can be checked against the model's
    assistant = page.locator(".message.assistant").last
    text = assistant.locator(".text")

    # a question: text streams in, then the turn completes with the model's reply
    q1 = {"role": "user", "content": "what is 2 plus 3?"}
    ask(page, q1["content"])
    partial = streamed_text(page)
    expect(page.locator("#stop")).to_be_visible()
    expect(assistant).to_have_attribute("data-state", "done")
    full = text.text_content()
    assert full == reference([q1]) and len(partial) < len(full) and full.startswith(partial)
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#stop")).to_be_hidden()

    # regenerate, then stop midway: the page keeps what came, the server stops generating
    assistant.get_by_role("button", name="Regenerate").click()
    streamed_text(page)
    page.click("#stop")
    expect(assistant).to_have_attribute("data-state", "stopped")
    stopped = text.text_content()
    assert 0 < len(stopped) < len(full) and full.startswith(stopped)
    stats = wait_idle(server.url)
    assert stats["requests"]["cancelled"] == 1 and stats["requests"]["completed"] == 1

    # edit the question: it goes back into the box, its answer is dropped; ask another
    page.locator(".message.user").last.get_by_role("button", name="Edit").click()
    expect(page.locator("#input")).to_have_value(q1["content"])
    expect(page.locator(".message")).to_have_count(0)
    q2 = {"role": "user", "content": "what is 12 plus 7?"}
    ask(page, q2["content"])
    expect(assistant).to_have_attribute("data-state", "done")
    a2 = {"role": "assistant", "content": text.text_content()}
    assert a2["content"] == reference([q2])

    # a second turn: the whole conversation is sent, so the reply is the one to that history
    q3 = {"role": "user", "content": "and what is 4 plus 4?"}
    ask(page, q3["content"])
    expect(assistant).to_have_attribute("data-state", "done")
    assert text.text_content() == reference([q2, a2, q3])
    expect(page.locator(".message")).to_have_count(4)
    shot = tmp_path / "chat_web.png"
    page.screenshot(path=str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("NANOCHAT_FAST_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["NANOCHAT_FAST_SCREENSHOT"])

    # an invalid setting: the server's one-line reason is shown and the question returns to the box
    page.fill("#top-k", "500")
    ask(page, "what is 1 plus 1?")
    expect(page.locator("#error")).to_have_text("top_k: Input should be less than or equal to 200")
    expect(page.locator("#input")).to_have_value("what is 1 plus 1?")
    expect(page.locator(".message")).to_have_count(4)
    page.fill("#top-k", "0")

    # new chat while a reply streams: the page empties and the server stops that reply too
    ask(page, "what is 1 plus 1?")
    streamed_text(page)
    page.click("#new-chat")
    expect(page.locator(".message")).to_have_count(0)
    expect(page.locator("#empty")).to_be_visible()
    expect(page.locator("#error")).to_be_hidden()
    stats = wait_idle(server.url)
    assert stats["requests"]["cancelled"] == 2 and stats["requests"]["completed"] == 3, stats

    # no script errors, no Content-Security-Policy violations: only the 400 asked for above
    assert problems == ["Failed to load resource: the server responded with a status of 400 (Bad Request)"]
    assert urls and all(u.startswith(server.url + "/") for u in urls), urls  # nothing from elsewhere
    page.close()
