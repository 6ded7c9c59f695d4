"""Issue 35 (trust, round three), point 7: fork safety. A child forked while a stream runs in
another thread gets a clear refusal from that Model, never a generate that waits forever on a lock
the vanished thread held; a Model idle at the fork works in the child, chat templates included."""

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import json, os, sys, threading, time
from dejavuu_build.runtime import load
m = load(sys.argv[1])
how = sys.argv[2]
chat = [{"role": "user", "content": "hello"}]
alone = m.generate("hello hello", max_new_tokens=8).tokens
chat_alone = m.generate(chat, max_new_tokens=4).tokens  # the parent's template renderer is up
started, stop = threading.Event(), threading.Event()
def run():
    for piece in m.stream("abcabcabc abc", max_new_tokens=400):
        started.set()
        if stop.is_set():
            break
        time.sleep(0.005)
t = None
if how == "busy":
    t = threading.Thread(target=run, daemon=True)
    t.start()
    started.wait(60)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    try:
        out = {"tokens": m.generate("hello hello", max_new_tokens=8).tokens,
               "chat": m.generate(chat, max_new_tokens=4).tokens}
    except BaseException as e:
        out = {"error": f"{type(e).__name__}: {e}"}
    os.write(w, json.dumps(out).encode())
    os._exit(0)
os.close(w)
deadline = time.time() + 60
while time.time() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    time.sleep(0.05)
else:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    print(json.dumps({"hung": True}))
    sys.exit(0)
child = json.loads(os.read(r, 1 << 20) or b"{}")
stop.set()
if t is not None:
    t.join(60)
parent = {"tokens": m.generate("hello hello", max_new_tokens=8).tokens, "chat": m.generate(chat, max_new_tokens=4).tokens}
print(json.dumps({"child": child, "parent": parent, "alone": alone, "chat_alone": chat_alone}))
"""


def _fork(tiny_llama, cache_dir, how):
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tiny_llama), how],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, DEJAVUU_CACHE=str(cache_dir)),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_child_forked_mid_stream_is_refused_clearly_and_the_parent_goes_on(tiny_llama, cache_dir):
    r = _fork(tiny_llama, cache_dir, "busy")
    assert not r.get("hung"), "the child's generate waited forever on the lock the stream's thread held"
    assert r["child"]["error"].startswith("GenerationError: this process was forked while this Model was generating")
    assert r["parent"] == {"tokens": r["alone"], "chat": r["chat_alone"]}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_child_forked_while_idle_generates_as_the_parent(tiny_llama, cache_dir):
    r = _fork(tiny_llama, cache_dir, "idle")
    assert not r.get("hung")
    assert r["child"] == {"tokens": r["alone"], "chat": r["chat_alone"]}, r
    assert r["parent"] == r["child"]
