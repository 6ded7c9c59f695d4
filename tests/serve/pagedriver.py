"""Driving the chat page (GET /) in Debian's headless Chromium through Selenium, with Debian's
chromedriver: nothing downloads a browser of its own. Shared by test_page.py and, run as a script,
the README's screenshot on a real build:

    python tests/serve/pagedriver.py smollm2-135m docs/images/chat-page.png
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

# an input-grounded task (editing given code), where drafting from the prompt pays
PROMPT = (
    "Rename the variables a and b to prev and curr in this function, and show the whole function:\n\n"
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"
)


def chromium_paths() -> tuple[str, str] | None:
    """(browser, driver) from the system (Debian: apt-get install chromium chromium-driver), or None."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def chrome(width: int = 1100, height: int = 900) -> webdriver.Chrome:
    paths = chromium_paths()
    if paths is None:
        raise RuntimeError("no chromium + chromedriver: apt-get install chromium chromium-driver")
    o = webdriver.ChromeOptions()
    o.binary_location = paths[0]
    for a in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={width},{height}",
    ):
        o.add_argument(a)
    o.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, for CSP reports
    return webdriver.Chrome(service=Service(paths[1]), options=o)


def open_page(d: webdriver.Chrome, url: str) -> None:
    d.get(url + "/")
    WebDriverWait(d, 30).until(lambda d: d.execute_script("return document.body.dataset.ready") == "true")


def type_text(el, text: str) -> None:
    """Type ``text`` as a user would, a new line as Shift+Enter (Enter alone sends)."""
    for i, line in enumerate(text.split("\n")):
        if i:
            el.send_keys(Keys.SHIFT, Keys.ENTER, Keys.SHIFT)
        el.send_keys(line)


def set_value(d: webdriver.Chrome, element_id: str, value: str) -> None:
    el = d.find_element(By.ID, element_id)
    el.clear()
    type_text(el, value)


def chat(d: webdriver.Chrome, text: str, timeout: float = 120) -> dict:
    """Type ``text``, press Enter, wait for the streamed reply; its text, draft spans and stats line."""
    n = len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    box = d.find_element(By.ID, "prompt")
    box.clear()
    type_text(box, text)
    box.send_keys(Keys.ENTER)
    WebDriverWait(d, timeout).until(
        lambda d: (
            len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done=true]")) > n
            or d.find_element(By.ID, "error").text
        )
    )
    assert not d.find_element(By.ID, "error").text, d.find_element(By.ID, "error").text
    return d.execute_script(
        """const m = [...document.querySelectorAll('.msg.assistant')].pop();
        const t = m.querySelector('.text');
        return {text: t.textContent, drafts: [...t.querySelectorAll('.draft')].map(e => e.textContent),
                stats: document.getElementById('stats').textContent};"""
    )


def compare(d: webdriver.Chrome, text: str, timeout: float = 240) -> dict:
    """Type ``text``, click compare, wait for both runs; the two texts, times and verdict."""
    set_value(d, "prompt", text)
    d.find_element(By.ID, "compare").click()
    WebDriverWait(d, timeout).until(
        lambda d: (
            d.find_element(By.ID, "compare-panel").get_attribute("data-done") == "true"
            or d.find_element(By.ID, "error").text
        )
    )
    assert not d.find_element(By.ID, "error").text, d.find_element(By.ID, "error").text
    return d.execute_script(
        """const col = (id) => document.getElementById(id);
        const part = (id, role) => col(id).querySelector(`[data-role=${role}]`).textContent;
        return {plain: part('cmp-plain', 'text'), method: part('cmp-method', 'text'),
                plain_time: part('cmp-plain', 'time'), method_time: part('cmp-method', 'time'),
                verdict: col('cmp-verdict').textContent,
                identical: col('compare-panel').dataset.identical};"""
    )


def full_page_png(d: webdriver.Chrome, path: Path, width: int = 1100) -> None:
    """A screenshot of the whole page (the window grown to the document's height)."""
    height = d.execute_script("return document.documentElement.scrollHeight")
    d.set_window_size(width, min(int(height) + 140, 6000))
    d.execute_script("window.scrollTo(0, 0)")
    path.parent.mkdir(parents=True, exist_ok=True)
    assert d.save_screenshot(str(path)), path


def main(name: str, out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from dejavuu_build.serve.bench import start_server

    proc, url = start_server(name, "--method", "suffix_decoding")
    d = chrome()
    try:
        open_page(d, url)
        set_value(d, "max-tokens", "64")
        compare(d, PROMPT)  # first: with the chat's answer in the history, compare would draft from it
        chat(d, PROMPT)
        full_page_png(d, Path(out))
    finally:
        d.quit()
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main(*sys.argv[1:3])
