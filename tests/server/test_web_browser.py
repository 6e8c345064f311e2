"""The web page in a real headless browser (issue 41): Chromium from the system's packages driven
by Selenium, against a live server (SmolLM2-135M + the shipped drafter, an API key set).

Checked: the page loads without the key; a message sent gets 401, the page asks for the key, and
with it the reply streams in; the reply's text is the model's (the same request through the API);
tokens from accepted drafts are marked, as many as the page's live counter shows; the statistics
(tokens/s, acceptance length, draft length, cached prompt tokens) are filled; the Stop button ends
a long generation. A screenshot is saved (to ``$DFLASH2_GGUF_SCREENSHOT`` when set: docs/web-page.png
is made with it).

Nothing is downloaded: Selenium is given the chromedriver and Chromium binaries (Selenium Manager
is never run). Skipped only when no Chromium / chromedriver is installed (scripts/setup.sh installs
Debian's ``chromium chromium-driver`` when it runs as root).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from live_server import LiveServer  # noqa: E402

from dflash2_gguf.server.app import ServerSettings  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KEY = "page-key"


def _find(env: str, names: tuple, fixed: tuple) -> str | None:
    """A browser or driver binary: ``$env``, then ``names`` on PATH, then ``fixed`` paths."""
    if os.environ.get(env):
        return os.environ[env]
    for n in names:
        p = shutil.which(n)
        if p:
            return p
    return next((p for p in fixed if os.access(p, os.X_OK)), None)


CHROMIUM = _find("DFLASH2_GGUF_CHROMIUM", ("chromium", "chromium-browser"), ("/usr/bin/chromium",))
CHROMEDRIVER = _find("DFLASH2_GGUF_CHROMEDRIVER", ("chromedriver",), ("/usr/bin/chromedriver",
                                                                       "/usr/lib/chromium/chromedriver"))

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="Chromium or chromedriver is not installed (Debian: apt-get install chromium chromium-driver; "
           "scripts/setup.sh does it as root; or set DFLASH2_GGUF_CHROMIUM / DFLASH2_GGUF_CHROMEDRIVER)")


@pytest.fixture(scope="module")
def server(native_ext, smollm2_gguf):
    s = ServerSettings(model=str(smollm2_gguf), model_draft=str(ROOT / "models" / "smollm2-135m-dflash2.gguf"),
                       n_ctx=1024, n_threads=1, adaptive=False, api_key=KEY, alias="SmolLM2-135M-Instruct")
    with LiveServer(s) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,860",
              "--force-color-profile=srgb", "--hide-scrollbars", "--no-first-run", "--disable-extensions"):
        opts.add_argument(a)
    d = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    try:
        yield d
    finally:
        d.quit()


def _wait(driver, cond, timeout: float = 300):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: cond(d))


def _set(driver, field: str, value) -> None:
    el = driver.find_element("id", field)
    el.clear()
    el.send_keys(str(value))


def test_page_chat_streams_with_draft_marks(server, browser, tmp_path):
    from selenium.webdriver.common.keys import Keys

    d = browser
    d.get(server.url + "/")
    assert d.title == "dflash2-gguf"
    system, question, n = "You are a helpful assistant.", "Count from 1 to 20, one number per line.", 72
    _set(d, "system", system)
    _set(d, "temperature", 0)
    _set(d, "max_tokens", n)
    d.find_element("id", "prompt").send_keys(question)
    d.find_element("id", "send").click()

    # the chat call got 401: the page asks for the key, then sends the message again with it
    _wait(d, lambda d: d.find_element("id", "keybox").is_displayed(), 60)
    assert "API key" in d.find_element("id", "error").text
    d.find_element("id", "apikey").send_keys(KEY)
    d.find_element("id", "savekey").click()
    _wait(d, lambda d: d.find_elements("css selector", ".msg.assistant .meta")
          and d.find_element("css selector", ".msg.assistant .meta").text)
    assert d.execute_script("return localStorage.getItem('dflash2-gguf.apiKey')") == KEY
    assert "SmolLM2-135M-Instruct" in d.find_element("id", "model").text

    reply = d.find_element("css selector", ".msg.assistant .body")
    # the model's reply: the same greedy request through the API gives the same text
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=300,
                   json={"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                         "max_tokens": n, "temperature": 0}).json()
    want = r["choices"][0]["message"]["content"]
    got = d.execute_script("return arguments[0].textContent", reply)
    assert got == want and len(want) > 20
    marked = reply.find_elements("css selector", ".tok.draft")
    tokens = reply.find_elements("css selector", ".tok")
    assert len(marked) >= 1 and len(tokens) > len(marked)
    # the page's counters: accepted / drafted, consistent with the marks it drew
    accepted, drafted = d.find_element("id", "stat-drafted").text.split(" accepted")[0].split(" / ")
    assert int(accepted) == len(marked) and int(drafted) >= int(accepted)
    assert float(d.find_element("id", "stat-tps").text) > 0
    assert float(d.find_element("id", "stat-al").text) > 1.0  # some cycle accepted a draft
    assert d.find_element("id", "stat-dn").text.split()[0].isdigit()
    assert d.find_element("id", "stat-cached").text.isdigit()
    # a marked token is visibly highlighted (its background is not the message's)
    bg = d.execute_script("return getComputedStyle(arguments[0]).backgroundColor", marked[0])
    plain = [t for t in tokens if "draft" not in t.get_attribute("class")][0]
    assert bg != d.execute_script("return getComputedStyle(arguments[0]).backgroundColor", plain)
    assert d.find_element("id", "send").is_enabled() and not d.find_element("id", "stop").is_enabled()

    shot = Path(os.environ.get("DFLASH2_GGUF_SCREENSHOT") or tmp_path / "web-page.png")
    shot.parent.mkdir(parents=True, exist_ok=True)
    assert d.save_screenshot(str(shot)) and shot.stat().st_size > 10_000

    # Stop: a long generation ends at the first tokens, marked as stopped; the page is usable again
    _set(d, "max_tokens", 2000)
    d.find_element("id", "prompt").send_keys("Write a very long story about a lighthouse keeper." + Keys.ENTER)
    _wait(d, lambda d: len(d.find_elements("css selector", ".msg.assistant")) == 2
          and d.find_elements("css selector", ".msg.assistant")[1].find_elements("css selector", ".tok"))
    assert d.find_element("id", "stop").is_enabled()
    d.find_element("id", "stop").click()
    meta = _wait(d, lambda d: d.find_elements("css selector", ".msg.assistant")[1]
                 .find_element("css selector", ".meta").text, 60)
    assert "stopped" in meta
    n_tok = int(meta.split(" tokens")[0])
    assert 1 <= n_tok < 2000
    assert d.find_element("id", "send").is_enabled()
