"""runtime.hugepages: the anonymous memory a session adds is collapsed into huge pages where it
is resident, sparse memory is left alone, the bytes stay the same, and it can be turned off."""

import ctypes
import mmap

import pytest

from dejavuu_build.runtime import hugepages as hp

MB = 1 << 20


def _resident(buf: mmap.mmap) -> int:
    """Pages of ``buf`` in memory (mincore)."""
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    n = len(buf) // hp.PAGE
    vec = (ctypes.c_ubyte * n)()
    assert hp._libc().mincore(addr, len(buf), vec) == 0
    return sum(v & 1 for v in vec)


@pytest.fixture
def available(monkeypatch):
    monkeypatch.setattr(hp, "_unavailable", None)
    why = hp._why_unavailable()
    if why:
        pytest.skip(f"huge pages cannot be collapsed here: {why}")
    return True


def test_resident_new_memory_is_collapsed_and_sparse_memory_is_not(available):
    pattern = bytes(range(256)) * (16 * MB // 256)
    before = hp.anon_extents()
    dense = mmap.mmap(-1, 16 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    sparse = mmap.mmap(-1, 16 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    dense.write(pattern)  # every page written, as onnxruntime writes its weights
    sparse[0] = 1  # one page of 4096
    rep = hp.collapse_new(before)
    if rep.skipped:  # the kernel said it has no MADV_COLLAPSE: nothing else is tried
        pytest.skip(rep.skipped)
    assert rep.collapsed >= 12 * MB  # the 2 MB-aligned pieces inside the 16 MB written
    assert dense[:] == pattern  # the same bytes, now on huge pages
    assert _resident(sparse) <= 16  # not filled in (a collapsed piece would be 512 pages)
    dense.close()
    sparse.close()


def test_memory_that_existed_before_is_left_alone(available):
    old = mmap.mmap(-1, 8 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    old.write(b"x" * (8 * MB))
    before = hp.anon_extents()
    rep = hp.collapse_new(before)
    if rep.skipped:
        pytest.skip(rep.skipped)
    assert rep.collapsed < 2 * MB  # nothing new was allocated: the 8 MB written before stay as they were


def test_turned_off_it_says_why_and_touches_nothing(monkeypatch, tiny_llama):
    from dejavuu_build import schema as S
    from dejavuu_build.runtime.session import make_session

    monkeypatch.setenv(hp.ENV, "0")
    monkeypatch.setattr(hp, "_unavailable", None)
    make_session(tiny_llama / S.variant_file("int4"), threads=1)
    assert hp.report.skipped == f"{hp.ENV}=0" and hp.report.collapsed == 0
