"""Transparent huge pages for what onnxruntime allocates when it opens a session (its copies of
the weights: prepacked 4- and 8-bit blocks, folded fp32 scales and minimums).

Why: a decode step streams ~124 MB of weights (SmolLM2-135M, exact int4). Where the kernel gives
huge pages only on request (``/sys/kernel/mm/transparent_hugepage/enabled`` = ``madvise``, the
common default), onnxruntime's allocations sit on 4 KB pages and every step walks ~30k of them
through the TLB. numpy asks for huge pages itself; onnxruntime's CPU allocator does not and has no
option to. Measured 2026-12-06 on a 2-core AMD EPYC (Zen 4, kernel 6.18, THP ``madvise``): ~240 MB
collapsed per SmolLM2 session, a one-token step 10.25 -> 9.22 ms at 2 threads (three alternating
runs, genai's graph in the same processes as the anchor), the same arithmetic and bits.

How: the anonymous memory a session's creation added is found from ``/proc/self/maps`` before and
after, and each 2 MB-aligned piece of it that is at least ``MIN_RESIDENT`` resident (``mincore``)
is collapsed into a huge page (``madvise(MADV_COLLAPSE)``, Linux >= 6.1) -- so sparse memory
(thread stacks, a lazily mapped KV buffer) is never filled in. Anything unavailable (another OS,
an older kernel, THP ``never``, ``DEJAVUU_HUGEPAGES=0``) leaves the session as onnxruntime made it
and says why once (``report``); nothing here can change a result.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from dataclasses import dataclass

from ..log import logger

HUGE = 2 << 20  # x86-64 and arm64 (4 KB base pages) PMD size
PAGE = 4096
MADV_COLLAPSE = 25  # linux/mman.h, Linux 6.1
MIN_RESIDENT = 0.9  # of a 2 MB piece's pages already in memory, or it is left alone
ENV = "DEJAVUU_HUGEPAGES"  # "0": off

Extents = dict[int, int]  # start -> end of private, writable, anonymous mappings


@dataclass
class Report:
    """What the last session's huge-page pass did: bytes collapsed, bytes tried but refused by the
    kernel, and why nothing was tried (None where it ran)."""

    collapsed: int = 0
    refused: int = 0
    skipped: str | None = None


_lock = threading.Lock()
_unavailable: str | None = None  # set once: why this process cannot collapse
_said = False
report = Report(skipped="no session opened yet")


def _why_unavailable() -> str | None:
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform})"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return "transparent huge pages are off on this machine ([never])"
    except OSError:
        return "this kernel has no transparent huge pages"
    return None


def anon_extents() -> Extents:
    """This process's private writable anonymous mappings (the heap included), start -> end."""
    out: Extents = {}
    with open("/proc/self/maps") as f:
        for line in f:
            p = line.split()
            if p[1].startswith("rw") and p[1][3] == "p" and (len(p) < 6 or p[5] == "[heap]"):
                s, e = (int(x, 16) for x in p[0].split("-"))
                out[s] = e
    return out


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def collapse_new(before: Extents) -> Report:
    """Collapse the resident 2 MB pieces of the anonymous memory added since ``before`` (new
    mappings, and the grown end of old ones) into huge pages."""
    global _unavailable
    rep = Report()
    if _unavailable is not None:
        rep.skipped = _unavailable
        return rep
    libc = _libc()
    for s, e in anon_extents().items():
        lo = max(s, before[s]) if s in before else s
        a, b = -(-lo // HUGE) * HUGE, e // HUGE * HUGE
        for piece in range(a, b, HUGE):
            vec = (ctypes.c_ubyte * (HUGE // PAGE))()
            if libc.mincore(piece, HUGE, vec) != 0:
                continue
            if sum(v & 1 for v in vec) < MIN_RESIDENT * len(vec):
                continue
            if libc.madvise(piece, HUGE, MADV_COLLAPSE) == 0:
                rep.collapsed += HUGE
                continue
            err = ctypes.get_errno()
            if err == 22:  # EINVAL: this kernel has no MADV_COLLAPSE
                _unavailable = f"this kernel ({os.uname().release}) has no MADV_COLLAPSE (Linux >= 6.1)"
                rep.skipped = _unavailable
                return rep
            rep.refused += HUGE  # EAGAIN / ENOMEM: no huge page free now; 4 KB pages stay
    return rep


def around_session(make):
    """Run ``make()`` (opening an onnxruntime session) and collapse what it allocated; returns
    its result. The pass is skipped, and why said once, where huge pages are unavailable."""
    global _unavailable, _said, report
    if _unavailable is None:
        _unavailable = _why_unavailable()
    before = anon_extents() if _unavailable is None else {}
    out = make()
    with _lock:
        report = collapse_new(before)
        if report.skipped and not _said:
            _said = True
            logger.info("huge pages for onnxruntime's weights: off (%s); decoding runs on 4 KB pages", report.skipped)
        elif not report.skipped:
            logger.debug(
                "huge pages: %d MB of the session's memory collapsed, %d MB refused",
                report.collapsed >> 20,
                report.refused >> 20,
            )
    return out
