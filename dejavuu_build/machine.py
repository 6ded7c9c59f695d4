"""The machine a figure was measured on: CPU model, its vector flags, onnxruntime's version.

One home for what every speed or exactness result names beside its numbers (the bench's and the
sweep's results.json, a replay recording, the exactness report): a ratio measured on AVX2 is a
hypothesis on AVX-512 + AMX, so a result that does not say where it ran cannot be read.
"""

from __future__ import annotations

import os
import platform
import time

VECTOR_FLAGS = ("avx", "amx")  # flag prefixes kept (avx, avx2, avx512*, avx_vnni, amx*), with fma and f16c


def cpu() -> tuple[str, list[str]]:
    """This CPU's model name and its vector flags (sorted; empty off Linux)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for ln in fh:
                if ln.startswith("model name") and model in ("", platform.machine()):
                    model = ln.split(":", 1)[1].strip()
                if ln.startswith("flags"):
                    flags = set(ln.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return model, sorted(f for f in flags if f.startswith(VECTOR_FLAGS) or f in ("fma", "f16c"))


def isa(flags: list[str]) -> str:
    """The widest vector ISA among ``flags``: "avx512", "avx2", or the machine's architecture."""
    if any(f.startswith("avx512") for f in flags):
        return "avx512"
    return "avx2" if "avx2" in flags else platform.machine()


def machine() -> dict:
    """CPU model, ISA and vector flags, onnxruntime's version (None where it is not installed): what a
    gate's record is compared with to decide whether it still holds here (keys fixed: a new key would
    re-run every recorded gate)."""
    try:
        import onnxruntime

        ort: str | None = onnxruntime.__version__
    except ImportError:
        ort = None
    model, flags = cpu()
    return {"cpu": model, "isa": isa(flags), "flags": flags, "onnxruntime": ort}


def run_facts() -> dict:
    """``machine()`` with the time and load of a timed run (load moves timings on a shared machine)."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = [0.0, 0.0, 0.0]
    return {
        **machine(),
        "arch": platform.machine(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "loadavg": load,
    }


def describe(m: dict) -> str:
    """One line: ``AMD EPYC (avx2: avx avx2 f16c fma), onnxruntime 1.32.0``."""
    return f"{m['cpu']} ({m['isa']}: {' '.join(m['flags']) or 'no vector flags'}), onnxruntime {m['onnxruntime']}"
