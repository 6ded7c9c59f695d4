"""Tokenizer and chat template without transformers: `tokenizers` + jinja2.

Chat templates come from model folders, so they run in jinja2's immutable sandbox, in a process of
their own, *and* within bounds (runtime.template_render): TEMPLATE_SECONDS of rendering (a hard
wall-clock limit: the process is killed, whatever single operation it is in), TEMPLATE_MAX_CHARS
for any string or list it builds and for its output, and a bound on the integers it computes. A
template past any bound is a GenerationError, never a hang, a held GIL or an aborted process.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

from ..errors import CacheError, GenerationError
from ..schema import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

TEMPLATE_SECONDS = 2.0  # a real chat template renders in milliseconds
TEMPLATE_MAX_CHARS = 1 << 22  # 4M characters: far more than any model's context holds


class TextTokenizer:
    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        folder = Path(folder)
        path = folder / TOKENIZER_FILE
        if not path.is_file():
            raise CacheError(f"{folder} has no {TOKENIZER_FILE}; rebuild it with `dejavuu-build tree-decoder`")

        def unreadable(name: str, e: BaseException) -> CacheError:
            return CacheError(
                f"{folder / name} cannot be read as a tokenizer file ({' '.join(str(e).split())[:160]}); "
                f"rebuild the entry with `dejavuu-build tree-decoder --force`"
            )

        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the tokenizers library's own error types
            raise unreadable(TOKENIZER_FILE, e) from None
        cfg = {}
        try:
            if (folder / TOKENIZER_CONFIG_FILE).is_file():
                cfg = json.loads((folder / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
                if not isinstance(cfg, dict):
                    raise ValueError("not a JSON object")
        except (OSError, ValueError, RecursionError) as e:
            raise unreadable(TOKENIZER_CONFIG_FILE, e) from None
        self.template = None
        try:
            if (folder / CHAT_TEMPLATE_FILE).is_file():
                self.template = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
            elif isinstance(cfg.get("chat_template"), str):
                self.template = cfg["chat_template"]
        except (OSError, ValueError) as e:
            raise unreadable(CHAT_TEMPLATE_FILE, e) from None

        def special(key):
            v = cfg.get(key)
            v = v.get("content") if isinstance(v, dict) else v
            return v if isinstance(v, str) else None

        self.bos_token = special("bos_token")
        self.eos_token = special("eos_token")
        self.add_bos = bool(cfg.get("add_bos_token", False))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.template:
            raise GenerationError("this model has no chat template: pass a plain prompt instead of --chat/messages")
        return render_bounded(
            self.template,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


# ------------------------------------------------------------------------------ incremental decoding
class IncrementalDecoder:
    """The text of a growing list of token ids, a piece per :meth:`push`, decoding only a short
    window each time (the tokens since the previous piece, plus the piece before them for context:
    spacing and multi-byte characters depend on neighbours). A piece never ends inside a character;
    the pieces, with :meth:`flush`, join to ``decode(all ids)``."""

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the window
        self.read = 0  # end of what has been emitted

    def push(self, ids) -> str:
        self.ids.extend(int(t) for t in ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        before = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        now = self.tok.decode(self.ids[self.prefix :], self.skip)
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before) :]
        return ""


# ------------------------------------------------------------------------------ bounded chat templates
# Templates render in worker processes (runtime.template_render): a pool of idle ones, each taking
# one render at a time, killed at the wall-clock bound whatever the template is doing, so a template
# never holds this process's GIL, memory or other requests.
_HARD_GRACE_S = 1.0  # past TEMPLATE_SECONDS: the worker's own tracer answers first where it can
_START_S = 60.0  # a worker's start (python + jinja2): a loaded machine can take seconds
_MAX_IDLE = 4
_idle: list[_TemplateWorker] = []
_pool_lock = threading.Lock()
_forked_away: list[_TemplateWorker] = []  # a forked child's copies of its parent's workers, never used


class _TemplateWorker:
    def __init__(self):
        script = Path(__file__).with_name("template_render.py")
        self.proc = subprocess.Popen(
            [sys.executable, "-I", str(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        self.answers: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, name="dejavuu-template-reader", daemon=True)
        self.reader.start()
        first = self._answer(_START_S)
        if not (isinstance(first, dict) and first.get("ready")):
            self.kill()
            raise GenerationError(
                "cannot start the chat template renderer (a Python process with jinja2): "
                "check that jinja2 is installed, or pass a plain prompt"
            )

    def _read(self) -> None:
        out = self.proc.stdout
        assert out is not None
        try:
            for line in out:
                try:
                    self.answers.put(json.loads(line))
                except ValueError:
                    self.answers.put(None)
        except (OSError, ValueError):
            pass
        self.answers.put(None)  # the worker is gone

    def _answer(self, seconds: float):
        try:
            return self.answers.get(timeout=seconds)
        except queue.Empty:
            return TimeoutError

    def render(self, request: dict, seconds: float):
        data = json.dumps(request).encode() + b"\n"
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            stdin.write(data)
            stdin.flush()
        except (OSError, ValueError):
            return None
        return self._answer(seconds)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


def _take_worker() -> _TemplateWorker:
    with _pool_lock:
        while _idle:
            w = _idle.pop()
            if w.alive():
                return w
            w.kill()
    return _TemplateWorker()


def _give_back(w: _TemplateWorker) -> None:
    with _pool_lock:
        if w.alive() and len(_idle) < _MAX_IDLE:
            _idle.append(w)
            return
    w.kill()


@atexit.register
def _stop_workers() -> None:
    with _pool_lock:
        workers = list(_idle)
        _idle.clear()
    for w in workers:
        w.kill()


def _after_fork_in_child() -> None:
    """A forked child never writes to its parent's workers (their pipes are shared): it starts its own."""
    global _pool_lock
    _forked_away.extend(_idle)  # kept referenced: closing them here could wait on a reader's lock
    _idle.clear()
    _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def render_bounded(source: str, **context) -> str:
    """Render a chat template within TEMPLATE_SECONDS and TEMPLATE_MAX_CHARS, or raise GenerationError."""
    request = {"source": source, "context": context, "seconds": TEMPLATE_SECONDS, "max_chars": TEMPLATE_MAX_CHARS}
    try:
        json.dumps(request)
    except (TypeError, ValueError) as e:
        raise GenerationError(
            f"chat messages must hold text, numbers, lists and dicts only ({' '.join(str(e).split())[:120]})"
        ) from None
    w = _take_worker()
    answer = w.render(request, TEMPLATE_SECONDS + _HARD_GRACE_S)
    if not isinstance(answer, dict):
        w.kill()
        why = f"ran longer than {TEMPLATE_SECONDS:g}s" if answer is TimeoutError else "stopped its renderer"
        raise GenerationError(f"chat template refused: it {why}; pass a plain prompt instead")
    _give_back(w)
    if "text" in answer and isinstance(answer["text"], str):
        return answer["text"]
    kind, msg = answer.get("error"), " ".join(str(answer.get("message", "")).split())[:300]
    if kind == "limit":
        raise GenerationError(f"chat template refused: it {msg}; pass a plain prompt instead")
    if kind == "parse":
        raise GenerationError(f"chat template does not parse ({msg}): pass a plain prompt instead")
    if kind == "raised":
        raise GenerationError(f"chat template: {msg}")
    raise GenerationError(f"chat template failed ({msg}); pass a plain prompt instead")
