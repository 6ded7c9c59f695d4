"""Issue 37: the chat page at GET / and the SSE extension it reads.

- Each step's committed ids reach ``on_tokens`` as a StepTokens (still a list) saying how many were
  accepted draft tokens and how many were drafted; the counts add up to the run's stats.
- MarkedStream sends exactly TextStream's text, every character marked by the token it came from
  (hypothesis: random steps, acceptances and stop strings on a hand-made vocabulary).
- The real server's stream carries per piece the spans and per step drafted/accepted counts, equal
  to what Model.generate's own steps report; plain decoding marks nothing.
- In headless Chromium (Debian's chromium + chromium-driver, driven by Selenium): a typed prompt
  streams a reply equal to Model.generate's, with the accepted-draft spans marked as the stream says
  and the page's acceptance figures equal to the engine's; compare shows identical texts (greedy and
  seeded sampling) with both times; text is inserted as text; it is keyboard usable and fits 320 px;
  it cannot reach another origin; a VLM build takes an attached image (a data URL); a screenshot is
  saved and is a real PNG.
"""

import base64
import json
import struct
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")

from dejavuu_build.runtime import load
from dejavuu_build.runtime.job import StepTokens
from dejavuu_build.runtime.stops import TextStream
from dejavuu_build.serve.bench import free_port, start_server
from dejavuu_build.serve.marks import MarkedStream

NAME = "tiny-llama"
VARIANT = "int4-static"
PROMPT = "the cat sat on the mat. the cat sat on the"
PAGE_MAX_TOKENS = 128  # what the page asks for by default


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load(tiny_llama, variant=VARIANT)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    proc, url = start_server(
        NAME, "--variant", VARIANT, "--method", "pld", log_path=str(tmp_path_factory.mktemp("srv") / "server.log")
    )
    yield url
    proc.terminate()
    proc.wait(30)


def messages(text):
    return [{"role": "user", "content": text}]


def ref_steps(model, prompt, **kw):
    """Model.generate's result and the StepTokens its job handed to on_tokens."""
    got: list = []
    res = model.generate(prompt, on_tokens=got.append, **kw)
    return res, got


def sse(url, body):
    """The streamed chunks of one chat request (the `data:` JSON objects, [DONE] left out)."""
    out = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()[:300]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))
    return out


# ---------------------------------------------------------------- the engine's per-step counts
@pytest.mark.parametrize("method", ["pld", "baseline"])
def test_each_step_says_how_its_tokens_were_produced(model, method):
    res, steps = ref_steps(model, messages(PROMPT), method=method, max_new_tokens=60)
    assert all(isinstance(s, list) for s in steps)  # callers that want a list get one
    assert [t for s in steps for t in s] == res.tokens
    assert steps[0].step is False and steps[0].accepted == 0 and len(steps[0]) == 1  # prefill's pick
    verify = steps[1:]
    assert all(s.step for s in verify) and len(verify) == res.stats.steps
    assert sum(s.drafted for s in verify) == res.stats.drafted
    assert all(0 <= s.accepted <= min(s.drafted, len(s)) for s in verify)
    # accept_hist is per step before the cut at the budget/EOS: the same where nothing was cut
    assert [s.accepted for s in verify] == [min(a, len(s)) for a, s in zip(res.stats.accept_hist, verify)]
    if method == "baseline":
        assert res.stats.drafted == 0
    else:
        assert sum(s.accepted for s in verify) > 0, "this prompt repeats: pld must land some drafts"


# ---------------------------------------------------------------- MarkedStream, exactly
VOCAB = ["a", "b", "ab", " ", "XY", "Y", "X", "hello", "\n", "é", "lo w"]


class FakeTokenizer:
    """Token i decodes to VOCAB[i]: each character's token is known."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(VOCAB[i] for i in ids)


_steps = st.lists(
    st.tuples(st.lists(st.integers(0, len(VOCAB) - 1), min_size=1, max_size=6), st.integers(0, 7)),
    min_size=1,
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(steps=_steps, stops=st.lists(st.sampled_from(["XY", "ab a", "Y\n", "lo", "é é"]), max_size=2))
def test_marked_stream_marks_every_character_by_its_token(steps, stops):
    tok = FakeTokenizer()
    marked, plain = MarkedStream(tok, stops), TextStream(tok, stops)
    truth: list[str] = []  # the source of every character of the whole decoded text
    sent, sources, reported = "", [], []
    for j, (ids, accepted) in enumerate(steps):
        s = StepTokens(ids, drafted=accepted + 1, accepted=accepted, step=j > 0)
        for i, t in enumerate(ids):
            truth += ["draft" if i < s.accepted else "model"] * len(VOCAB[t])
        spans = marked.push(s)
        assert "".join(x["text"] for x in spans) == plain.push(s)  # the same text, piece by piece
        assert all(a["source"] != b["source"] for a, b in zip(spans, spans[1:]))  # merged runs
        for x in spans:
            sent += x["text"]
            sources += [x["source"]] * len(x["text"])
        reported += marked.take_steps()
    rest = marked.finish()
    assert "".join(x["text"] for x in rest) == plain.finish()
    for x in rest:
        sent += x["text"]
        sources += [x["source"]] * len(x["text"])
    assert sources == truth[: len(sent)]
    assert reported == [
        {"tokens": len(ids), "drafted": acc + 1, "accepted": min(acc, len(ids))} for ids, acc in steps[1:]
    ]


# ---------------------------------------------------------------- the SSE extension, real server
@pytest.mark.parametrize("method", ["pld", "baseline"])
def test_stream_carries_spans_and_steps_equal_to_the_engine(model, server, method):
    body = {"model": NAME, "messages": messages(PROMPT), "max_tokens": 60, "temperature": 0, "method": method}
    chunks = sse(server, {**body, "stream_options": {"include_usage": True}})
    res, steps = ref_steps(model, messages(PROMPT), method=method, max_new_tokens=60)
    content = [c for c in chunks if c["choices"]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in content)
    assert text == res.text
    spans, got_steps = [], []
    for c in content[1:]:  # (the first carries the role only)
        ext = c["dejavuu"]
        assert "".join(s["text"] for s in ext["spans"]) == (c["choices"][0]["delta"].get("content") or "")
        spans += ext["spans"]
        got_steps += ext["steps"]
    assert got_steps == [{"tokens": len(s), "drafted": s.drafted, "accepted": s.accepted} for s in steps[1:]]
    usage = chunks[-1]
    assert usage["dejavuu"]["steps"] == len(got_steps) and usage["dejavuu"]["drafted"] == res.stats.drafted
    drafted_text = "".join(s["text"] for s in spans if s["source"] == "draft")
    if method == "baseline":
        assert drafted_text == "" and not any(s["drafted"] for s in got_steps)
    else:
        assert drafted_text and sum(s["accepted"] for s in got_steps) > 0


def test_page_files_are_served_with_a_same_origin_policy(server):
    r = httpx.get(server + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "connect-src 'self'" in csp and "script-src 'self'" in csp and "default-src 'none'" in csp
    for name, kind in (("app.js", "javascript"), ("style.css", "css")):
        r = httpx.get(server + "/static/" + name)
        assert r.status_code == 200 and kind in r.headers["content-type"] and len(r.content) > 500
    for bad in ("../app.py", "..%2Fapp.py", "index.html", "nothing.js"):
        assert httpx.get(server + "/static/" + bad).status_code == 404, bad
    info = httpx.get(server + "/info").json()
    assert info["model"] == NAME and "pld" in info["methods"] and info["method"] == "pld" and info["vision"] is False


def test_the_page_files_are_package_data():
    """pyproject's package-data ships every file the server serves (a wheel without them 500s)."""
    from fnmatch import fnmatch

    tomllib = pytest.importorskip("tomllib")

    from dejavuu_build.serve.app import PAGE_DIR, PAGE_FILES

    root = Path(__file__).resolve().parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data["dejavuu_build.serve"]
    for name in PAGE_FILES:
        assert (PAGE_DIR / name).is_file(), name
        assert any(fnmatch(f"{PAGE_DIR.name}/{name}", g) for g in globs), (name, globs)


# ---------------------------------------------------------------- in a real browser
try:
    import pagedriver as browser_mod  # (tests/serve/pagedriver.py: selenium, from the test extra)
except ImportError:
    browser_mod = None


@pytest.fixture(scope="module")
def driver():
    if browser_mod is None:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    if browser_mod.chromium_paths() is None:
        pytest.skip("no chromium + chromedriver (apt-get install chromium chromium-driver; .ci/run does)")
    d = browser_mod.chrome()
    yield d
    d.quit()


def is_png(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    w, h = struct.unpack(">II", data[16:24])
    assert w > 0 and h > 0 and len(data) > 2000, (w, h, len(data))
    return w, h


def test_page_streams_a_reply_with_accepted_drafts_marked(model, server, driver, tmp_path):
    browser_mod.open_page(driver, server)
    got = browser_mod.chat(driver, PROMPT)
    res, steps = ref_steps(model, messages(PROMPT), method="pld", max_new_tokens=PAGE_MAX_TOKENS)
    assert got["text"] == res.text
    # the marked spans are the stream's draft spans (the same request, streamed by hand)
    chunks = sse(server, {"model": NAME, "messages": messages(PROMPT), "max_tokens": PAGE_MAX_TOKENS, "temperature": 0})
    want = [s["text"] for c in chunks if c.get("dejavuu") for s in c["dejavuu"]["spans"] if s["source"] == "draft"]
    assert got["drafts"] == want and want
    accepted, drafted = sum(s.accepted for s in steps), sum(s.drafted for s in steps)
    assert f"({accepted} of {drafted} drafted tokens)" in got["stats"], got["stats"]
    assert f"{len(steps) - 1} steps" in got["stats"] and "tok/s" in got["stats"]
    png = tmp_path / "page.png"
    browser_mod.full_page_png(driver, png)
    is_png(png)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.8, 7)])
def test_compare_shows_identical_texts_and_both_times(model, server, driver, temperature, seed):
    browser_mod.open_page(driver, server)
    browser_mod.set_value(driver, "temperature", str(temperature))
    if seed is not None:
        browser_mod.set_value(driver, "seed", str(seed))
    got = browser_mod.compare(driver, PROMPT)
    assert got["identical"] == "true" and got["plain"] == got["method"], got
    assert got["verdict"].startswith("Identical texts")
    assert " s · " in got["plain_time"] and " s · " in got["method_time"]
    if seed is not None:  # sampled: both equal the seeded Model.generate
        ref = model.generate(messages(PROMPT), max_new_tokens=PAGE_MAX_TOKENS, temperature=temperature, seed=seed)
        assert got["plain"] == ref.text


def test_text_is_inserted_as_text_and_the_page_is_keyboard_usable(server, driver):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    browser_mod.open_page(driver, server)
    hostile = '<img src=x onerror="document.body.dataset.pwned=1"><b>bold</b>'
    browser_mod.chat(driver, hostile)
    shown = driver.execute_script(
        "return [document.querySelector('.msg.user .text').textContent, document.querySelectorAll('#log img, #log b').length,"
        " document.body.dataset.pwned || null]"
    )
    assert shown == [hostile, 0, None]
    box = driver.find_element(By.ID, "prompt")
    box.send_keys("a", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "b")  # Shift+Enter: a new line, not a send
    assert box.get_attribute("value") == "a\nb"
    assert len(driver.find_elements(By.CSS_SELECTOR, ".msg.user")) == 1
    box.send_keys(Keys.TAB)  # the next stop is the Send button (the image row is hidden: no VLM)
    assert driver.switch_to.active_element.get_attribute("id") == "send"
    driver.switch_to.active_element.send_keys(Keys.ENTER)  # a keyboard press of Send sends
    browser_mod.WebDriverWait(driver, 60).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done=true]")) == 2
    )
    for el in driver.find_elements(By.CSS_SELECTOR, "input, select, textarea, button"):
        if el.is_displayed():  # every visible control has a name a screen reader can say
            name = driver.execute_script(
                "const e = arguments[0]; return (e.labels && e.labels.length ? e.labels[0].textContent : '') ||"
                " e.getAttribute('aria-label') || e.textContent",
                el,
            )
            assert name.strip(), el.get_attribute("outerHTML")


def test_the_page_fits_320_px_and_reaches_no_other_origin(server, driver, tmp_path):
    browser_mod.open_page(driver, server)
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride", {"width": 320, "height": 720, "deviceScaleFactor": 1, "mobile": True}
    )
    try:
        driver.get(server + "/")
        browser_mod.WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.body.dataset.ready"))
        browser_mod.compare(driver, "abc abc abc")
        fit = driver.execute_script(
            """const r = (id) => document.getElementById(id).getBoundingClientRect();
            return {page: document.documentElement.scrollWidth, inner: window.innerWidth,
                    right: Math.max(...['prompt', 'send', 'compare', 'method', 'log', 'cmp-plain', 'cmp-method']
                                      .map((id) => r(id).right)),
                    stacked: r('cmp-method').top >= r('cmp-plain').bottom};"""
        )
        assert fit["inner"] == 320 and fit["page"] <= 320 and fit["right"] <= 320, fit
        assert fit["stacked"], fit  # the two compare columns sit one above the other
        png = tmp_path / "narrow.png"
        assert driver.save_screenshot(str(png))
        assert is_png(png)[0] == 320
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    other = f"http://127.0.0.1:{free_port()}/v1/models"
    outcome = driver.execute_async_script(
        """const done = arguments[arguments.length - 1];
        fetch(arguments[0]).then(() => done('reached'), (e) => done('blocked: ' + e.name));""",
        other,
    )
    assert outcome.startswith("blocked"), outcome
    violations = [e for e in driver.get_log("browser") if "Content Security Policy" in e.get("message", "")]
    assert any("connect-src" in e["message"] for e in violations), violations


# ---------------------------------------------------------------- a VLM build: attach an image
@pytest.fixture(scope="module")
def vlm(cache_dir):
    from tiny import save_tiny

    from dejavuu_build.build.config import TreeDecoderConfig
    from dejavuu_build.build.pipeline import build_tree_decoder

    src = save_tiny("smolvlm", cache_dir.parent / "src-tiny-vlm-page")
    cfg = TreeDecoderConfig(
        model=str(src),
        name="tiny-vlm-page",
        primary_input="inputs_embeds",
        vision=True,
        vision_position_ids="transformers",
        timing=False,
        reference_tokens=12,
        variants=("fp32",),
    )
    return build_tree_decoder(cfg).folder


def test_a_vlm_build_takes_an_attached_image(vlm, driver, tmp_path):
    import numpy as np
    from PIL import Image
    from selenium.webdriver.common.by import By

    img_path = tmp_path / "random.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(img_path)
    proc, url = start_server("tiny-vlm-page", "--method", "pld", log_path=str(tmp_path / "server.log"))
    try:
        browser_mod.open_page(driver, url)
        assert driver.find_element(By.ID, "image-row").is_displayed()
        driver.find_element(By.ID, "image").send_keys(str(img_path))
        browser_mod.WebDriverWait(driver, 10).until(lambda d: d.find_element(By.ID, "image-preview").is_displayed())
        text = "Describe this image."
        got = browser_mod.chat(driver, text)
        src = driver.execute_script("return document.querySelector('.msg.user img').getAttribute('src')")
        assert src == "data:image/png;base64," + base64.b64encode(img_path.read_bytes()).decode()
        m = load(vlm)
        ref = m.generate(
            [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"}]}],
            images=[Image.open(img_path)],
            method="pld",
            max_new_tokens=PAGE_MAX_TOKENS,
        )
        assert got["text"] == ref.text
        no_image = m.generate(
            [{"role": "user", "content": [{"type": "text", "text": text}]}], max_new_tokens=PAGE_MAX_TOKENS
        )
        assert ref.text != no_image.text, "the image changed nothing: was it sent?"
        assert not driver.find_element(By.ID, "image-preview").is_displayed()  # cleared after sending
    finally:
        proc.terminate()
        proc.wait(30)
