"""Chat templates rendered bounded, in a process of their own (runtime.tokenizer starts and feeds it).

This file runs as a script (``python -I template_render.py``) as well as a module, so it imports
nothing from the package: only the standard library and jinja2.

Inside the worker a template runs in jinja2's immutable sandbox with three bounds: ``seconds`` of
rendering (checked between the template's Python lines), ``max_chars`` for any string or list it
builds and for its output (checked before a repetition, concatenation, padding or join allocates),
and MAX_INT_BITS for any integer it computes (checked before a power or a product is computed). One
C-level operation can still run long (``str`` of a list nested a million deep, a sort): the parent
does not wait for it, it kills this process at its own wall-clock limit, so nothing a template does
ever holds the parent's GIL or memory. The worker also caps its own address space (MEMORY_BYTES).

Protocol: one JSON object a line. The worker says ``{"ready": true}`` once; then, for each request
``{"source", "context", "seconds", "max_chars"}``, answers ``{"text": ...}`` or
``{"error": KIND, "message": ...}`` with KIND one of limit (a bound), parse (the template does not
parse), raised (the template's own raise_exception) and failed (any other error).
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time

MAX_INT_BITS = 1 << 16  # an integer of 65,536 bits (~20,000 digits): far more than a template needs
MEMORY_BYTES = 1 << 30  # the worker's address space


class TemplateLimit(BaseException):
    """Raised from inside a render; a BaseException so no `except Exception` on the way swallows it."""


class Raised(Exception):
    """The template's own raise_exception(msg)."""


class Refused(Exception):
    """What a render ended with, other than text: (kind, message)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _bounds(max_chars: int):
    def too_big(n, what: str = "a string or list") -> None:
        if n > max_chars:
            raise TemplateLimit(f"builds {what} of {n:,} items (the bound is {max_chars:,})")

    def size(x) -> int:
        return len(x) if isinstance(x, (str, list, tuple, bytes)) else 0

    def integer(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    def check_repeat(a, b) -> None:
        for seq, n in ((a, b), (b, a)):
            if isinstance(seq, (str, list, tuple, bytes)) and integer(n):
                too_big(len(seq) * max(n, 0))

    wide = re.compile(r"\d{7,}")  # a width or precision of a million or more

    def check_format(fmt, args=(), kwargs=None) -> None:
        if isinstance(fmt, str) and wide.search(fmt):
            raise TemplateLimit("formats with a width of millions of characters")
        vals = list(args if isinstance(args, (list, tuple)) else [args]) + list((kwargs or {}).values())
        if isinstance(fmt, str) and any(integer(v) and abs(v) > max_chars for v in vals) and ("*" in fmt or "{" in fmt):
            raise TemplateLimit("formats with a computed width of millions of characters")

    def check_join(items, sep="") -> list:
        items = list(items)
        too_big(len(items), "a list")
        too_big(sum(len(x) if isinstance(x, str) else 0 for x in items) + len(sep or "") * len(items), "a string")
        return items

    def check_int(operator: str, left, right) -> None:
        """Integer sizes bounded before they are computed: ``**`` and ``*`` of two integers."""
        if not (integer(left) and integer(right)):
            return
        if operator == "**" and abs(left) > 1 and right > 0:
            bits = (abs(left).bit_length() - 1) * right
        elif operator == "*":
            bits = abs(left).bit_length() + abs(right).bit_length()
        else:
            return
        if bits > MAX_INT_BITS:
            raise TemplateLimit(f"computes an integer of about {bits:,} bits (the bound is {MAX_INT_BITS:,})")

    def check_str_call(s: str, name: str, args, kwargs) -> None:
        first = args[0] if args else None
        if name in ("center", "ljust", "rjust", "zfill") and integer(first):
            too_big(first)
        elif name == "expandtabs":
            too_big(len(s) + s.count("\t") * (first if isinstance(first, int) else 8))
        elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
            too_big(len(s) + (s.count(args[0]) + (not args[0]) * (len(s) + 1)) * len(args[1]))
        elif name == "join" and args:
            check_join(args[0], s)
        elif name in ("format", "format_map"):
            check_format(s, args, kwargs)

    return too_big, size, check_repeat, check_format, check_join, check_int, check_str_call


def bounded_env(max_chars: int):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    too_big, size, check_repeat, check_format, check_join, check_int, check_str_call = _bounds(max_chars)

    class Env(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        @staticmethod
        def concat(parts):  # the template's, macros' and call blocks' output
            return "".join(check_join(parts))

        def call_binop(self, context, operator, left, right):
            check_int(operator, left, right)
            if operator == "*":
                check_repeat(left, right)
            elif operator == "+":
                too_big(size(left) + size(right))
            elif operator == "%":
                check_format(left, right)
            out = super().call_binop(context, operator, left, right)
            too_big(size(out))
            return out

        def call(__self, __context, __obj, *args, **kwargs):
            target = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
            if isinstance(getattr(target, "__self__", None), str):
                check_str_call(target.__self__, getattr(target, "__name__", ""), args, kwargs)
            out = super().call(__context, __obj, *args, **kwargs)
            too_big(size(out))
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

    guard("center", lambda value, width=80, *a, **k: too_big(width) if integer_(width) else None)
    guard(
        "indent",
        lambda s, width=4, *a, **k: too_big(
            len(str(s)) + (str(s).count("\n") + 1) * (len(width) if isinstance(width, str) else int(width))
        ),
    )
    guard("replace", lambda ctx, s, old, new, *a, **k: check_str_call(str(s), "replace", (str(old), str(new)), {}))
    guard("join", lambda ctx, value, d="", *a, **k: check_join(value, d) if isinstance(value, (list, tuple)) else None)
    guard("format", lambda value, *args, **kw: check_format(value, args, kw))
    env.globals["raise_exception"] = _raise_exception
    env.check_join = check_join  # type: ignore[attr-defined]  # for the `~` joins of each template
    env.too_big = too_big  # type: ignore[attr-defined]
    return env


def integer_(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _raise_exception(msg):
    raise Raised(str(msg))


@functools.lru_cache(maxsize=8)
def _compiled(source: str, max_chars: int):
    env = bounded_env(max_chars)
    try:
        tmpl = env.from_string(source)  # constant expressions are folded (and bounded) here
    except TemplateLimit as e:
        raise Refused("limit", str(e)) from None
    except Exception as e:  # noqa: BLE001 - a syntax error in the model's template
        raise Refused("parse", f"{type(e).__name__}: {str(e)[:200]}") from None
    # `~` joins through the template's own module globals: bound those joins too.
    g = tmpl.root_render_func.__globals__
    for fn in ("str_join", "markup_join"):
        if fn in g and not isinstance(g[fn], functools.partial):
            g[fn] = functools.partial(lambda real, seq: real(env.check_join(seq)), g[fn])
    return env, tmpl


def render(source: str, context: dict, seconds: float, max_chars: int) -> str:
    """The template rendered within the bounds, or Refused(kind, message)."""
    env, tmpl = _compiled(source, max_chars)
    deadline = time.monotonic() + seconds

    def tracer(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateLimit(f"ran longer than {seconds:g}s")
        return tracer

    previous = sys.gettrace()
    out, n = [], 0
    sys.settrace(tracer)
    try:
        for piece in tmpl.generate(**context):
            n += len(piece)
            env.too_big(n, "an output")
            out.append(piece)
    except TemplateLimit as e:
        raise Refused("limit", str(e)) from None
    except Raised as e:
        raise Refused("raised", str(e)) from None
    except Exception as e:  # noqa: BLE001 - the template's own failure (recursion, type errors, ...)
        raise Refused("failed", f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    finally:
        sys.settrace(previous)
    return "".join(out)


def _limit_self() -> None:
    """Cap this worker's memory, and end it with its parent (Linux)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        want = MEMORY_BYTES if hard == resource.RLIM_INFINITY else min(MEMORY_BYTES, hard)
        if soft == resource.RLIM_INFINITY or soft > want:
            resource.setrlimit(resource.RLIMIT_AS, (want, hard))
    except (ImportError, ValueError, OSError):
        pass
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def main() -> None:
    _limit_self()
    import jinja2.sandbox  # noqa: F401 - imported before saying ready, so a render's time is its own

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer

    def say(obj) -> None:
        stdout.write(json.dumps(obj).encode() + b"\n")
        stdout.flush()

    say({"ready": True})
    for line in stdin:
        try:
            req = json.loads(line)
            say({"text": render(req["source"], req["context"], float(req["seconds"]), int(req["max_chars"]))})
        except Refused as e:
            say({"error": e.kind, "message": str(e)})
        except MemoryError:
            say({"error": "failed", "message": "MemoryError: the template needed more memory than it may use"})
        except Exception as e:  # noqa: BLE001 - a malformed request: answered, never a dead worker
            say({"error": "failed", "message": f"{type(e).__name__}: {str(e)[:200]}"})


if __name__ == "__main__":
    main()
