"""Issue 35 (trust, round three), point 2: a chat template renders in a process of its own, under a
hard wall-clock limit that no single operation escapes, with integer sizes bounded before they are
computed; while it renders, the calling process's other threads keep running (its GIL is free)."""

import os
import subprocess
import sys
import time

import pytest

from dejavuu_build.errors import GenerationError
from dejavuu_build.runtime import tokenizer as T

MESSAGES = [{"role": "user", "content": "hi"}]

# Run in a child Python with its memory capped, so a template that escapes its bounds fails the test
# (by the timeout) instead of taking the test run, or the machine, with it.
_SCRIPT = r"""
import json, resource, sys, threading, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from dejavuu_build.runtime import tokenizer as T
T.render_bounded("{{ messages[0].content }}", messages=[{"role": "user", "content": "warm"}])
gaps, done = [], threading.Event()
def tick():
    last = time.perf_counter()
    while not done.is_set():
        time.sleep(0.01)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
def ordinary(out):
    time.sleep(0.3)  # while the hostile one renders
    t0 = time.perf_counter()
    T.render_bounded("{% for m in messages %}{{ m.content }}{% endfor %}", messages=[{"role": "user", "content": "ok"}])
    out.append(time.perf_counter() - t0)
threading.Thread(target=tick, daemon=True).start()
other = []
side = threading.Thread(target=ordinary, args=(other,), daemon=True)
side.start()
t0 = time.perf_counter()
try:
    T.render_bounded(sys.argv[1], messages=[{"role": "user", "content": "hi"}])
    said = "rendered"
except Exception as e:
    said = f"{type(e).__name__}: {e}"
elapsed = time.perf_counter() - t0
side.join(30)
done.set()
time.sleep(0.05)
print(json.dumps({"said": said, "elapsed": elapsed, "max_gap": max(gaps), "other": other}))
"""


def _render_in_child(template: str, timeout: float = 60) -> dict:
    import json

    try:
        out = subprocess.run(
            [sys.executable, "-c", _SCRIPT, template], capture_output=True, text=True, timeout=timeout, env=os.environ
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the template was still rendering after {timeout}s: {template}")
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


BOUND = T.TEMPLATE_SECONDS + 2.0  # the hard limit (a second past the bound), and a second for a loaded machine


@pytest.mark.parametrize(
    "template,needle",
    [
        # the reproduction: one huge-integer operation that never returns to the line tracer
        ("{% set a = 10 ** 1024 %}{% set b = a ** 1024 %}{% set c = b ** 1024 %}{{ c }}", "integer"),
        ("{% set a = 7 ** 60000 %}{{ a * a }}", "integer"),
        # one C-level operation on a bounded list that runs (and allocates) for hours
        ("{% set a = [[1] * 4000000] * 4000000 %}{{ a }}", "ran longer than"),
        ("{% set a = [[1] * 4000000] * 4000000 %}{{ a|tojson }}", "ran longer than"),
        # loops: the bound holds, not 4.3 s against 2 s
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran longer than"),
    ],
)
def test_no_single_operation_escapes_the_bound_and_other_threads_keep_running(template, needle):
    r = _render_in_child(template)
    assert r["said"].startswith("GenerationError: chat template refused") and needle in r["said"], r
    assert r["elapsed"] < BOUND, r
    assert r["max_gap"] < 0.5, r  # this process's GIL was never held for long
    assert r["other"] and r["other"][0] < 1.5, r  # another render went on meanwhile


def test_integer_bounds_leave_ordinary_arithmetic_alone():
    assert T.render_bounded("{{ 2 ** 64 }} {{ 10 ** 300 > 0 }} {{ (3 * 4) ** 2 }}", messages=MESSAGES) == (
        f"{2**64} True 144"
    )


def test_a_template_that_kills_its_renderer_is_one_error_and_the_next_render_works():
    t0 = time.perf_counter()
    with pytest.raises(GenerationError, match="chat template"):
        T.render_bounded("{% set a = [[1] * 4000000] * 4000000 %}{{ a }}", messages=MESSAGES)
    assert time.perf_counter() - t0 < BOUND + 5  # (a fresh worker may have had to start)
    assert T.render_bounded("{{ messages[0].content }}!", messages=MESSAGES) == "hi!"


def test_template_errors_keep_their_messages():
    with pytest.raises(GenerationError, match=r"^chat template: only user and assistant$"):
        T.render_bounded("{{ raise_exception('only user and assistant') }}", messages=MESSAGES)
    with pytest.raises(GenerationError, match="does not parse"):
        T.render_bounded("{% if %}", messages=MESSAGES)
    with pytest.raises(GenerationError, match="chat template failed"):
        T.render_bounded("{{ messages[5].content.upper() }}", messages=MESSAGES)
    with pytest.raises(GenerationError, match="chat messages must hold text"):
        T.render_bounded("{{ messages }}", messages=[{"role": "user", "content": "x", "extra": object()}])
