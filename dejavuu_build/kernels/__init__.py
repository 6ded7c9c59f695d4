"""Native operators that both the quantizer (which packs weights for them) and the runtime (which
registers them with onnxruntime) read: each a C++ source compiled on the user's machine on first use,
so that installing the package stays pure Python.

Importing this package needs numpy and the standard library only; onnxruntime is imported lazily,
inside the functions that register an operator."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from . import attn, q41

# onnxruntime domain -> what registers its operator with a SessionOptions (returns the ISA path):
# the runtime registers those a graph imports, and only from here (never a library a model names).
# One library holds both (q41.SOURCES): registering it once registers every domain it has.
OPERATORS: dict[str, Callable[[Any], str]] = {q41.DOMAIN: q41.register, attn.DOMAIN: q41.register}
_UNAVAILABLE: dict[str, Callable[[], str | None]] = {q41.DOMAIN: q41.unavailable, attn.DOMAIN: q41.unavailable}


def register(session_options: Any, domains: Iterable[str]) -> None:
    """Register with ``session_options`` the libraries of ``domains`` (each library once: a second
    registration of the same domains is refused by onnxruntime). Unknown domains are ignored."""
    seen = set()
    for domain in sorted(domains):
        reg = OPERATORS.get(domain)
        if reg is not None and reg not in seen:
            seen.add(reg)
            reg(session_options)


def unavailable(domains: Iterable[str]) -> str | None:
    """Why an operator of ``domains`` cannot run on this machine (one line), or None where every
    one builds, loads and registers. Never raises."""
    for domain in domains:
        check = _UNAVAILABLE.get(domain)
        why = check() if check is not None else "no such operator in this version of dejavuu_build"
        if why is not None:
            return f"{domain}: {why}"
    return None
