"""dejavuu_build.machine: the CPU facts every speed and exactness figure is named with."""

from __future__ import annotations

from pathlib import Path

import pytest

from dejavuu_build.machine import cpu, describe, isa, machine, run_facts


def test_isa_is_the_widest_vector_extension():
    assert isa(["avx", "avx2", "avx512bw", "avx512f", "amx_int8", "fma"]) == "avx512"
    assert isa(["avx", "avx2", "f16c", "fma"]) == "avx2"
    assert isa([]) not in ("avx2", "avx512")


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads Linux's /proc/cpuinfo")
def test_flags_are_this_cpus_vector_flags():
    """Exactly the avx*/amx*/fma/f16c flags /proc/cpuinfo lists (AVX2 machines included, where a
    filter on avx512/amx alone recorded none), and the keys a gate's record is compared with."""
    line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    listed = set(line.split(":", 1)[1].split())
    model, flags = cpu()
    assert flags == sorted(f for f in listed if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))
    m = machine()
    assert set(m) == {"cpu", "isa", "flags", "onnxruntime"} and m["flags"] == flags and m["cpu"] == model
    assert m["isa"] == isa(flags)
    facts = run_facts()
    assert {k: facts[k] for k in m} == m and len(facts["loadavg"]) == 3
    assert describe(m).startswith(f"{model} ({m['isa']}: ") and m["onnxruntime"] in describe(m)
