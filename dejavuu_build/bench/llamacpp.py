"""The llama.cpp peer: the source GGUF itself in llama.cpp, plain greedy decoding and prompt lookup.

A GGUF user already has llama.cpp, so ``--compare llamacpp`` times it beside our methods:

* **The same file, the same ids.** The peer loads the GGUF our build's manifest records (its
  sha256 checked), at the file's own quantization; prompts are our tokenizer's ids, fed as
  tokens (``llama_decode``), never text; the EOS ids are ours.
* **Counted like ours.** The prompt's forward and the first token are prefill; every later
  forward is a decode step. Greedy = the argmax of the step's logits (what llama.cpp's greedy
  sampler picks), computed here so both methods share one code path.
* **Its prompt lookup** (``llamacpp-lookup``) is llama-cpp-python's
  ``LlamaPromptLookupDecoding`` (``max_ngram_size=2, num_pred_tokens=10``): the latest n-gram's
  first earlier match drafts the next ``num_pred_tokens`` ids, one batched forward verifies them
  (logits for every row), the greedy-equal prefix is kept and the rest of the KV cache dropped
  (``llama_memory_seq_rm``). Written here because that class lives in llama-cpp-python, which
  must be compiled from source (15-50 minutes on 2 cores); the loop is 20 lines over the C API.
* **Which llama.cpp.** The C API through ``llama-cpp-py-sync`` (a prebuilt CPU wheel: its cffi
  declarations and its ``libllama.so``; ``pip install -e ".[llamacpp]"``), or a build of your own
  named by ``DEJAVUU_LLAMA_CPP_LIB=/path/libllama.so`` (e.g. with AVX-512 kernels: the wheel's are
  AVX2 only, and ``describe()`` records the library's own system info). The wheel's libraries
  ask for glibc 2.38 for four C23 parsing functions only (``__isoc23_strtol`` …); on an older
  glibc they are loaded from a patched copy (:func:`glibc_compat_copy`) in the peers' cache.
* **OpenMP spins briefly** (``GOMP_SPINCOUNT=10000``) unless you set ``OMP_WAIT_POLICY`` or
  ``GOMP_SPINCOUNT``: the wheel's llama.cpp is built with OpenMP, whose threads meet at a barrier
  per op. Spinning without end (``ACTIVE``) keeps its threads busy after a step, in our process,
  and halved our own decoding beside it (49 vs 125 tok/s); waiting passively makes every barrier
  a wake-up (quiet AVX-512 Xeon, SmolLM2-135M: 35 tok/s passive, 121 with 10000 spins, 107 with
  100000, 100 active; 2026-12-05). On a loaded 2-core machine (load 8-10) the order flips (passive
  9.8-10.2 tok/s, 10000 spins 6.1, 100000 1.6, default spinning 0.4): there no figure means much.
  ``describe()`` records the policy it ran with.
* **A peer that cannot run is one line**, and the bench goes on without it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any, Sequence

from ..errors import DejavuuError
from ..log import logger
from ..schema import PEERS_DIR, sha256_file
from .config import BenchError
from .peer import KINDS, PeerResult, one_line

LLAMACPP, LLAMACPP_LOOKUP = KINDS["llamacpp"].methods  # plain decoding, prompt lookup
INSTALL_HINT = 'pip install -e ".[llamacpp]" (or pip install llama-cpp-py-sync)'
LIB_ENV = "DEJAVUU_LLAMA_CPP_LIB"
SPINCOUNT = "10000"  # GOMP_SPINCOUNT unless the user sets a wait policy (module docstring: measured)
LOOKUP = (2, 10)  # llama-cpp-python's LlamaPromptLookupDecoding defaults: max_ngram_size, num_pred_tokens
N_CTX = 4096  # KV positions of the peer's context (prompt + generation must fit)
N_BATCH = 512  # ids per prefill forward


class PeerError(BenchError):
    """The llama.cpp peer cannot run here (no library, no GGUF, a failing forward)."""


# ---------------------------------------------------------------------------------- the library
def _glibc() -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in os.confstr("CS_GNU_LIBC_VERSION").split()[1].split("."))  # type: ignore[union-attr]
    except (ValueError, IndexError, AttributeError, OSError):
        return (0,)


def _elf_hash(name: bytes) -> int:
    h = 0
    for c in name:
        h = ((h << 4) + c) & 0xFFFFFFFF
        g = h & 0xF0000000
        if g:
            h ^= g >> 24
        h &= ~g & 0xFFFFFFFF
    return h


C23 = b"__isoc23_"  # glibc 2.38's C23 variants of strtol & co.: the same function but for "0b" prefixes


def patch_c23(data: bytearray, glibc: tuple[int, ...]) -> int:
    """Rewrite an x86-64 ELF's needs of glibc versions newer than ``glibc`` in place, when they are
    only ``__isoc23_*`` functions: each such symbol is pointed at its classic name (the tail of the
    same string, so no string moves), made unversioned, and the version need is renamed to an older
    version of the same library. Returns the symbols rewritten; PeerError if anything else needs a
    newer glibc. No library does this (patchelf renames symbols but cannot drop a version need)."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise PeerError("not a little-endian 64-bit ELF")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    by_type = {s[1]: s for s in secs}
    verneed, dynsym, versym = by_type.get(0x6FFFFFFE), by_type.get(11), by_type.get(0x6FFFFFFF)
    if verneed is None or dynsym is None or versym is None:
        return 0
    strtab = secs[verneed[6]][4]

    def name_at(off: int) -> bytes:
        o = strtab + off
        return bytes(data[o : data.index(0, o)])

    def version(name: bytes) -> tuple[int, ...] | None:
        if not name.startswith(b"GLIBC_2."):
            return None
        return tuple(int(x) for x in name[6:].decode().split("."))

    newer: dict[int, int] = {}  # version index -> offset of its vernaux entry
    older: tuple[int, int] | None = None  # (hash, name offset) of a version this glibc has
    off = verneed[4]
    while True:
        _, cnt, _, aux, nxt = struct.unpack_from("<HHIII", data, off)
        a = off + aux
        for _ in range(cnt):
            h, _, other, nm, anext = struct.unpack_from("<IHHII", data, a)
            v = version(name_at(nm))
            if v is not None and v > glibc:
                newer[other] = a
            elif v is not None:
                older = (h, nm)
            a += anext
        if not nxt:
            break
        off += nxt
    if not newer:
        return 0
    if older is None:
        raise PeerError("no older glibc version to fall back on")
    dstr = secs[dynsym[6]][4]
    n = 0
    for i in range(dynsym[5] // 24):
        idx = struct.unpack_from("<H", data, versym[4] + 2 * i)[0] & 0x7FFF
        if idx not in newer:
            continue
        st_name = struct.unpack_from("<I", data, dynsym[4] + 24 * i)[0]
        o = dstr + st_name
        sym = bytes(data[o : data.index(0, o)])
        if not sym.startswith(C23):
            raise PeerError(f"{sym.decode()} needs a newer glibc than {'.'.join(map(str, glibc))}")
        struct.pack_into("<I", data, dynsym[4] + 24 * i, st_name + len(C23))
        struct.pack_into("<H", data, versym[4] + 2 * i, 1)  # VER_NDX_GLOBAL: the library's default
        n += 1
    for a in newer.values():
        struct.pack_into("<I", data, a, older[0])
        struct.pack_into("<I", data, a + 8, older[1])
    return n


def glibc_compat_copy(src: Path, cache: Path) -> Path:
    """``src``'s folder of shared libraries copied to ``cache/.peers/llamacpp-lib-<sha>`` with
    :func:`patch_c23` applied (once: staged, then renamed into place); the copy's ``libllama.so``."""
    lib = src / "libllama.so"
    digest = sha256_file(lib)[:16]
    final = cache / PEERS_DIR / f"llamacpp-lib-{digest}"
    if (final / "libllama.so").is_file():
        return final / "libllama.so"
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    glibc = _glibc()
    for f in sorted(src.iterdir()):
        if ".so" not in f.name:
            continue
        if f.is_symlink():
            os.symlink(os.readlink(f), staging / f.name)
            continue
        data = bytearray(f.read_bytes())
        patch_c23(data, glibc)
        (staging / f.name).write_bytes(data)
    try:
        staging.rename(final)
    except OSError:  # another process put it in place first
        shutil.rmtree(staging, ignore_errors=True)
    return final / "libllama.so"


def require_llamacpp(cache: Path | None = None) -> tuple[Any, Any, str]:
    """(cffi FFI, the loaded library, its path), or PeerError saying how to get it."""
    try:
        import llama_cpp_py_sync
        from llama_cpp_py_sync._cffi_bindings import get_ffi  # the C API's declarations only
    except ImportError:
        raise PeerError(f"--compare llamacpp needs llama.cpp's C API: {INSTALL_HINT}") from None
    ffi = get_ffi()
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPINCOUNT  # read once, when the OpenMP runtime loads (module docstring)
    own = os.environ.get(LIB_ENV)
    path = Path(own) if own else Path(llama_cpp_py_sync.__file__).parent / "libllama.so"
    if not path.is_file():
        raise PeerError(f"{path} is not a file ({LIB_ENV} names llama.cpp's libllama.so)")
    try:
        lib = ffi.dlopen(str(path))
    except OSError as e:
        if own or "GLIBC_" not in str(e):
            raise PeerError(f"llama.cpp's library does not load here: {one_line(e)[:300]}") from None
        from ..cache import cache_root

        path = glibc_compat_copy(path.parent, cache or cache_root())
        try:
            lib = ffi.dlopen(str(path))
        except OSError as e2:
            raise PeerError(f"llama.cpp's library does not load here: {one_line(e2)[:300]}") from None
    return ffi, lib, str(path)


# ---------------------------------------------------------------------------------- the peer
def lookup_draft(ids: Sequence[int], max_ngram_size: int, num_pred_tokens: int) -> list[int]:
    """llama-cpp-python's ``LlamaPromptLookupDecoding.find_candidate_pred_tokens``: for n-gram sizes
    from ``max_ngram_size`` down to 1, the first earlier occurrence of the last n ids that is
    followed by ``num_pred_tokens`` whole ids gives those ids; none: no draft."""
    n_ids = len(ids)
    for size in range(min(max_ngram_size, n_ids - 1), 0, -1):
        tail = list(ids[-size:])
        for i in range(n_ids - size + 1):
            start, end = i + size, i + size + num_pred_tokens
            if list(ids[i:start]) == tail and end <= n_ids and start < n_ids - size:
                return [int(t) for t in ids[start:end]]
    return []


class LlamaCppPeer:
    """llama.cpp's greedy decoding of a GGUF, fed our token ids (``llamacpp``)."""

    name = LLAMACPP

    def __init__(self, gguf: Path, threads: int, eos_ids: Sequence[int] = (), n_ctx: int = N_CTX):
        import numpy as np

        self.np = np
        self.gguf = Path(gguf)
        self.threads = int(threads)
        self.eos_ids = [int(e) for e in eos_ids]
        self.ffi, self.lib, self.lib_path = require_llamacpp()
        ffi, lib = self.ffi, self.lib
        self._quiet = ffi.callback("void(enum ggml_log_level, const char *, void *)", lambda *a: None)
        lib.llama_log_set(self._quiet, ffi.NULL)
        lib.llama_backend_init()
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(str(self.gguf).encode(), mp)
        if self.model == ffi.NULL:
            raise PeerError(f"llama.cpp cannot load {self.gguf}")
        cp = lib.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = N_BATCH
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, cp)
        if self.ctx == ffi.NULL:
            raise PeerError(f"llama.cpp cannot make a context of {n_ctx} positions for {self.gguf.name}")
        self.n_ctx = int(lib.llama_n_ctx(self.ctx))
        self.n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model)))
        self.mem = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(N_BATCH, 0, 1)

    def close(self) -> None:
        lib = getattr(self, "lib", None)
        if lib is None:  # __init__ stopped before the library was loaded
            return
        if getattr(self, "batch", None) is not None:
            lib.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None) is not None:
            lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None) is not None:
            lib.llama_model_free(self.model)
            self.model = None

    __del__ = close

    # the forward
    def _decode(self, ids: Sequence[int], pos: int, logits: str) -> None:
        """``ids`` at positions ``pos``..; row logits for "last" or "all" rows."""
        b = self.batch
        b.n_tokens = len(ids)
        for i, t in enumerate(ids):
            b.token[i] = int(t)
            b.pos[i] = pos + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if logits == "all" or i == len(ids) - 1 else 0
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise PeerError(f"llama_decode returned {rc} ({len(ids)} ids at position {pos})")

    def _row(self, i: int):
        ptr = self.lib.llama_get_logits_ith(self.ctx, i)
        return self.np.frombuffer(self.ffi.buffer(ptr, 4 * self.n_vocab), dtype=self.np.float32)

    def _argmax(self, i: int) -> int:
        return int(self._row(i).argmax())

    def _prefill(self, ids: Sequence[int]) -> int:
        """A fresh cache, then ``ids`` in chunks of N_BATCH; the argmax of the last row."""
        self.lib.llama_memory_clear(self.mem, True)
        for s in range(0, len(ids), N_BATCH):
            self._decode(ids[s : s + N_BATCH], s, "last")
        return self._argmax(-1)

    def _check(self, ids: Sequence[int], max_new_tokens: int) -> None:
        if not ids:
            raise PeerError("llama.cpp needs at least one prompt id")
        if len(ids) + max_new_tokens > self.n_ctx:
            raise PeerError(
                f"prompt ({len(ids)}) + {max_new_tokens} new tokens exceed the peer's {self.n_ctx} positions"
            )

    def logits(self, ids: Sequence[int]):
        """Every position's logits of ``ids`` (one teacher-forced pass), ``[len(ids), vocab]``."""
        np = self.np
        self.lib.llama_memory_clear(self.mem, True)
        out = np.empty((len(ids), self.n_vocab), np.float32)
        for s in range(0, len(ids), N_BATCH):
            chunk = ids[s : s + N_BATCH]
            self._decode(chunk, s, "all")
            for i in range(len(chunk)):
                out[s + i] = self._row(i)
        return out

    def generate(self, ids: Sequence[int], max_new_tokens: int, *, ignore_eos: bool = False) -> PeerResult:
        return self._generate([int(t) for t in ids], max_new_tokens, ignore_eos, None)

    def _generate(
        self, ids: list[int], max_new_tokens: int, ignore_eos: bool, lookup: tuple[int, int] | None
    ) -> PeerResult:
        self._check(ids, max_new_tokens)
        eos = set() if ignore_eos else set(self.eos_ids)
        t0 = time.perf_counter()
        tokens = [self._prefill(ids)]
        t1 = last = time.perf_counter()
        steps: list[float] = []
        drafted = accepted = 0
        while tokens[-1] not in eos and len(tokens) < max_new_tokens:
            seq = ids + tokens
            draft = lookup_draft(seq, *lookup)[: max_new_tokens - len(tokens) - 1] if lookup else []
            self._decode([tokens[-1], *draft], len(seq) - 1, "all" if draft else "last")
            got = [self._argmax(0 if draft else -1)]
            for i, d in enumerate(draft):  # the greedy-equal prefix of the draft, then one token more
                if got[-1] != d or got[-1] in eos:
                    break
                got.append(self._argmax(i + 1))
            if draft:
                drafted += len(draft)
                accepted += len(got) - 1
                self.lib.llama_memory_seq_rm(self.mem, 0, len(seq) + len(got) - 1, -1)
            for t in got:
                tokens.append(t)
                if t in eos or len(tokens) == max_new_tokens:
                    break
            now = time.perf_counter()
            steps.append(now - last)
            last = now
        reason = "eos" if tokens[-1] in eos else "length"
        spec = None
        if lookup:
            spec = {"draft_tokens_evaluated": drafted, "draft_tokens_accepted": accepted, "forwards": len(steps)}
        return PeerResult(tokens, len(ids), t1 - t0, last - t0, steps, reason, len(steps) if lookup else None, spec)

    def system_info(self) -> str:
        return self.ffi.string(self.lib.llama_print_system_info()).decode(errors="replace").strip()

    def describe(self) -> dict:
        try:
            import llama_cpp_py_sync

            pkg = Path(llama_cpp_py_sync.__file__).parent
            native = json.loads((pkg / "native_manifest.json").read_text())
            version = {"llama_cpp_py_sync": getattr(llama_cpp_py_sync, "__version__", "?")}
            version["llama_cpp_commit"] = native.get("llama_cpp_commit", "?")
        except (ImportError, OSError, ValueError):
            version = {}
        return {
            "gguf": str(self.gguf),
            "library": self.lib_path,
            **version,
            "system_info": self.system_info(),
            "threads": self.threads,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
            "n_ctx": self.n_ctx,
            "eos_token_id": self.eos_ids,
            "search": "greedy (argmax of each row's logits), our token ids in, max_new_tokens per generation",
        }

    def quality(self, model_folder: str | Path) -> dict:
        """The GGUF in llama.cpp on our quality gate (``peer.peer_quality``), scored once."""
        from .peer import peer_quality

        if getattr(self, "_quality", None) is None:
            self._quality = peer_quality(self, model_folder, self.threads, self.n_ctx, self.name)
            logger.info(
                "llama.cpp on the quality gate: top-1 %.3f vs fp32, mean KL %.4f",
                self._quality["top1"],
                self._quality["mean_kl"],
            )
        return self._quality


class LlamaCppLookup:
    """llama.cpp with llama-cpp-python's prompt-lookup drafting (``llamacpp-lookup``): the same
    model and context as :class:`LlamaCppPeer`, chains verified by one batched forward."""

    name = LLAMACPP_LOOKUP
    plain = LLAMACPP

    def __init__(self, peer: LlamaCppPeer, options: tuple[int, int] = LOOKUP):
        self.peer = peer
        self.options = (int(options[0]), int(options[1]))

    def generate(self, ids: Sequence[int], max_new_tokens: int, *, ignore_eos: bool = False) -> PeerResult:
        return self.peer._generate([int(t) for t in ids], max_new_tokens, ignore_eos, self.options)

    def quality(self, model_folder: str | Path) -> dict:
        return self.peer.quality(model_folder)

    def describe(self) -> dict:
        n, k = self.options
        return {
            **self.peer.describe(),
            "speculative": {"max_ngram_size": n, "num_pred_tokens": k, "as": "LlamaPromptLookupDecoding"},
        }


def source_gguf(manifest) -> Path:
    """The GGUF our build was made from, checked against the sha256 the manifest records."""
    src = getattr(manifest, "source", None) or {}
    path = Path(src.get("path") or "")
    if not str(path).endswith(".gguf"):
        raise PeerError(f"llama.cpp runs GGUF files; this build's source is {src.get('id') or 'unknown'}")
    if not path.is_file():
        raise PeerError(f"the source GGUF {path} is gone: rebuild the model or fetch its source again")
    want = src.get("sha256")
    if want and sha256_file(path) != want:
        raise PeerError(f"{path} is not the file this model was built from (sha256 differs)")
    return path


def load_llamacpp_peers(manifest, threads: int, eos_ids: Sequence[int] = ()) -> tuple[list, str | None]:
    """([llamacpp, llamacpp-lookup], None), checked by one short generation, or ([], one line why)."""
    try:
        peer = LlamaCppPeer(source_gguf(manifest), threads, eos_ids)
        peer.generate(list(range(8)), 2)
    except Exception as e:  # noqa: BLE001 - its library, its file, its forward: one line, the bench goes on
        why = str(e) if isinstance(e, DejavuuError) else f"{type(e).__name__}: {one_line(e)}"
        line = f"llama.cpp peer skipped, it cannot run this model here: {why[:400]}"
        logger.warning(line)
        return [], line
    return [peer, LlamaCppLookup(peer)], None


def require() -> None:
    """The peer kind's check before anything slow (``peer.PeerKind.require``)."""
    require_llamacpp()


def load_peers(ctx) -> list:
    """llama.cpp plain and prompt lookup on the source GGUF; [] with one warning line if it cannot run."""
    return load_llamacpp_peers(ctx.model.manifest, ctx.cfg.threads, ctx.model.eos_ids)[0]
