"""Native operators that both the quantizer (which packs weights for them) and the runtime (which
registers them with onnxruntime) read: each a C++ source compiled on the user's machine on first use,
so that installing the package stays pure Python.

Importing this package needs numpy and the standard library only; onnxruntime is imported lazily,
inside the functions that register an operator."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from . import q41

# onnxruntime domain -> what registers its operator with a SessionOptions (returns the ISA path):
# the runtime registers those a graph imports, and only from here (never a library a model names)
OPERATORS: dict[str, Callable[[Any], str]] = {q41.DOMAIN: q41.register}
_UNAVAILABLE: dict[str, Callable[[], str | None]] = {q41.DOMAIN: q41.unavailable}


def unavailable(domains: Iterable[str]) -> str | None:
    """Why an operator of ``domains`` cannot run on this machine (one line), or None where every
    one builds, loads and registers. Never raises."""
    for domain in domains:
        check = _UNAVAILABLE.get(domain)
        why = check() if check is not None else "no such operator in this version of dejavuu_build"
        if why is not None:
            return f"{domain}: {why}"
    return None
