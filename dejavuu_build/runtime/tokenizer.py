"""Tokenizer and chat template without transformers: `tokenizers` + jinja2.

Chat templates come from model folders, so they run in jinja2's immutable sandbox *and* within
bounds: TEMPLATE_SECONDS of rendering (checked between the template's Python lines), and
TEMPLATE_MAX_CHARS for any string or list it builds and for its output (checked before a
repetition, concatenation, padding or join allocates). A template past either bound is a
GenerationError, never a hang or an aborted process.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
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
        self.tok = Tokenizer.from_file(str(path))
        cfg = {}
        if (folder / TOKENIZER_CONFIG_FILE).is_file():
            cfg = json.loads((folder / TOKENIZER_CONFIG_FILE).read_text())
        self.template = None
        if (folder / CHAT_TEMPLATE_FILE).is_file():
            self.template = (folder / CHAT_TEMPLATE_FILE).read_text()
        elif isinstance(cfg.get("chat_template"), str):
            self.template = cfg["chat_template"]

        def special(key):
            v = cfg.get(key)
            return v.get("content") if isinstance(v, dict) else v

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
class _TemplateLimit(BaseException):
    """Raised from inside a render; a BaseException so no `except Exception` on the way swallows it."""


def _too_big(n, what: str = "a string or list") -> None:
    if n > TEMPLATE_MAX_CHARS:
        raise _TemplateLimit(f"builds {what} of {n:,} items (the bound is {TEMPLATE_MAX_CHARS:,})")


def _size(x) -> int:
    return len(x) if isinstance(x, (str, list, tuple, bytes)) else 0


def _check_repeat(a, b) -> None:
    for seq, n in ((a, b), (b, a)):
        if isinstance(seq, (str, list, tuple, bytes)) and isinstance(n, int) and not isinstance(n, bool):
            _too_big(len(seq) * max(n, 0))


_WIDE = re.compile(r"\d{7,}")  # a width or precision of a million or more


def _check_format(fmt, args=(), kwargs=None) -> None:
    if isinstance(fmt, str) and _WIDE.search(fmt):
        raise _TemplateLimit("formats with a width of millions of characters")
    vals = list(args if isinstance(args, (list, tuple)) else [args]) + list((kwargs or {}).values())
    if (
        isinstance(fmt, str)
        and any(isinstance(v, int) and not isinstance(v, bool) and abs(v) > TEMPLATE_MAX_CHARS for v in vals)
        and ("*" in fmt or "{" in fmt)
    ):
        raise _TemplateLimit("formats with a computed width of millions of characters")


def _check_join(items, sep="") -> list:
    items = list(items)
    _too_big(len(items), "a list")
    _too_big(sum(len(x) if isinstance(x, str) else 0 for x in items) + len(sep or "") * len(items), "a string")
    return items


def _check_str_call(s: str, name: str, args, kwargs) -> None:
    first = args[0] if args else None
    if name in ("center", "ljust", "rjust", "zfill") and isinstance(first, int):
        _too_big(first)
    elif name == "expandtabs":
        _too_big(len(s) + s.count("\t") * (first if isinstance(first, int) else 8))
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _too_big(len(s) + (s.count(args[0]) + (not args[0]) * (len(s) + 1)) * len(args[1]))
    elif name == "join" and args:
        _check_join(args[0], s)
    elif name in ("format", "format_map"):
        _check_format(s, args, kwargs)


def _bounded_env():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Env(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        @staticmethod
        def concat(parts):  # the template's, macros' and call blocks' output
            return "".join(_check_join(parts))

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                _check_repeat(left, right)
            elif operator == "+":
                _too_big(_size(left) + _size(right))
            elif operator == "%":
                _check_format(left, right)
            elif (
                operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 1024
            ):
                raise _TemplateLimit(f"computes {left} ** {right}")
            out = super().call_binop(context, operator, left, right)
            _too_big(_size(out))
            return out

        def call(__self, __context, __obj, *args, **kwargs):
            target = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
            if isinstance(getattr(target, "__self__", None), str):
                _check_str_call(target.__self__, getattr(target, "__name__", ""), args, kwargs)
            out = super().call(__context, __obj, *args, **kwargs)
            _too_big(_size(out))
            return out

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals.pop("lipsum", None)  # generates text of any length

    def guard(name, check):
        real = env.filters[name]

        @functools.wraps(real)
        def filt(*a, **kw):
            check(*a, **kw)
            return real(*a, **kw)

        env.filters[name] = filt

    guard("center", lambda value, width=80, *a, **k: _too_big(width) if isinstance(width, int) else None)
    guard(
        "indent",
        lambda s, width=4, *a, **k: _too_big(
            len(str(s)) + (str(s).count("\n") + 1) * (len(width) if isinstance(width, str) else int(width))
        ),
    )
    guard("replace", lambda ctx, s, old, new, *a, **k: _check_str_call(str(s), "replace", (str(old), str(new)), {}))
    guard("join", lambda ctx, value, d="", *a, **k: _check_join(value, d) if isinstance(value, (list, tuple)) else None)
    guard("format", lambda value, *args, **kw: _check_format(value, args, kw))
    return env


def render_bounded(source: str, **context) -> str:
    """Render a chat template within TEMPLATE_SECONDS and TEMPLATE_MAX_CHARS, or raise GenerationError."""
    env = _bounded_env()

    def raise_exception(msg):
        raise GenerationError(f"chat template: {msg}")

    env.globals["raise_exception"] = raise_exception
    try:
        tmpl = env.from_string(source)  # constant expressions are folded (and bounded) here
    except _TemplateLimit as e:
        raise GenerationError(f"chat template refused: it {e}; pass a plain prompt instead") from None
    except Exception as e:  # noqa: BLE001 - a syntax error in the model's template
        raise GenerationError(
            f"chat template does not parse ({type(e).__name__}: {str(e)[:200]}): pass a plain prompt instead"
        ) from None
    # `~` joins through the template's own module globals: bound those joins too.
    g = tmpl.root_render_func.__globals__
    for fn in ("str_join", "markup_join"):
        if fn in g:
            g[fn] = functools.partial(lambda real, seq: real(_check_join(seq)), g[fn])
    deadline = time.monotonic() + TEMPLATE_SECONDS

    def tracer(frame, event, arg):
        if time.monotonic() > deadline:
            raise _TemplateLimit(f"ran longer than {TEMPLATE_SECONDS:g}s")
        return tracer

    previous = sys.gettrace()
    out, n = [], 0
    sys.settrace(tracer)
    try:
        for piece in tmpl.generate(**context):
            n += len(piece)
            _too_big(n, "an output")
            out.append(piece)
    except _TemplateLimit as e:
        raise GenerationError(f"chat template refused: it {e}; pass a plain prompt instead") from None
    except GenerationError:
        raise
    except Exception as e:  # noqa: BLE001 - the template's own failure (recursion, type errors, ...)
        raise GenerationError(
            f"chat template failed ({type(e).__name__}: {' '.join(str(e).split())[:200]}); pass a plain prompt instead"
        ) from None
    finally:
        sys.settrace(previous)
    return "".join(out)
