"""What a KV layout is and what its drivers share.

A layout module (layouts.concat, layouts.static, layouts.rowwise) defines one ``LAYOUT``, a
``Layout``: what the build does with it (its graph pass, step line, place in the default's
preference, row-guard rule, batched serving graph) and the two classes that feed its graphs:
a ``Driver`` for one request -- its feeds and its KV cache, what the runtime's Decoder, the build's
gates (build.runner) and timings run -- and, where the layout has a batched serving graph, a
``BatchDriver``, what the server's scheduler runs (serve.batch opens it). The registry
(layouts/__init__.py) reads the modules' entries; the Decoder, the gates and the server look a
graph's layout up there and drive it through these classes only.

Import-time cost: numpy and the package's schema, errors and runtime.tree; the graph passes (onnx)
are imported when a build runs them and onnxruntime when a graph is bound, so the runtime and the
server import the layouts without torch or onnx.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, Sequence, TypeVar

import numpy as np

from .. import schema as S
from ..errors import GenerationError
from ..runtime.tree import causal_inputs, slot_tokens, step_inputs

Out = tuple[np.ndarray, np.ndarray | None, list[np.ndarray] | None]  # logits, hidden states, present (concat)


@dataclass(frozen=True)
class Layout:
    """One KV layout: the registry's entry, defined by its module as ``LAYOUT``."""

    name: str  # schema.KV_*: the string graphs (schema.KV_LAYOUT_KEY) and manifests carry
    rank: int  # preference at equal precision for the default (0 first; timing may still displace it)
    in_place: bool  # a bound buffer of `capacity` positions (capacity()), written where the step says
    driver: type[Driver]  # feeds one request's rows and keeps its KV (runtime.decoder.Decoder holds one)
    step: str = ""  # the build's step line for its graph pass ({p}: precision, {c}: capacity)
    # (concat proto, capacity) -> this layout's graph (ExportError: no such flavour); None: the export itself
    graph_pass: Callable[[Any, int], Any] | None = None
    optional: bool = True  # a graph the pass does not apply to: the build goes on without it (else raises)
    batch: str = S.KV_STATIC  # the layout whose batched serving graph a default of this layout gets
    # (proto of this layout, its name) -> its batched serving graph (ContractError: does not apply)
    batch_pass: Callable[[Any, str], Any] | None = None
    batch_driver: type[BatchDriver[Any]] | None = None  # drives that batched graph (serve.batch)
    # (proto of this layout, its name) -> its prefill graph, run on the same KV buffer (ContractError:
    # does not apply); None: prompts run on the decode graph
    prefill_pass: Callable[[Any, str], Any] | None = None

    @property
    def suffix(self) -> str:
        return S.LAYOUT_SUFFIXES.get(self.name, "")


def capacity(max_context: int | None, max_positions: int) -> int:
    """An in-place KV buffer's length: --max-context, else the model's limit capped at
    DEFAULT_MAX_CONTEXT (pages are only touched as a context grows; sizes: docs/runtime.md)."""
    if max_context:
        return int(max_context)
    return int(min(max_positions or S.DEFAULT_MAX_CONTEXT, S.DEFAULT_MAX_CONTEXT))


def kv_dtype(c: S.Contract) -> np.dtype:
    """The KV buffers' element type."""
    return np.dtype(np.float16 if c.kv_dtype == "float16" else np.float32)


def kv_zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A zeroed in-place KV buffer whose memory is touched only as contexts grow, in 4 KiB pages.
    Why not np.zeros: where transparent huge pages are on (``always``), a capacity-8192 buffer's
    every layer and kv head is one 2 MiB page that a context's first token faults in and zeroes
    whole. Measured on a 2-core AMD EPYC VM (SmolLM2-135M, docs/speed.md, twenty-fifth session):
    a process's first `generate` 1385 -> 178 ms (a short prompt), a server's first batched step of
    8 new slots seconds -> 75 ms, decode speed at a past of 1000 unchanged (141.8 / 139.4 against
    141.9 / 140.2 steps a second); resident memory follows the contexts held again. Where madvise
    is missing (not Linux) it is np.zeros."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dt.itemsize
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is None or nbytes < (1 << 21):
        return np.zeros(shape, dt)
    buf = mmap.mmap(-1, nbytes)  # anonymous: zero-filled by the kernel, page by page on first touch
    buf.madvise(advice)
    return np.frombuffer(buf, dt).reshape(shape)


@dataclass
class Rows:
    """What one request feeds a forward: graph rows (tokens, parents per row or None for a chain)
    and, for inputs_embeds decoders, the rows' embeddings."""

    tokens: list[int]
    parents: list[int] | None
    embeds: np.ndarray | None = None  # [rows, hidden]
    slots: list[int] | None = None  # a tree's aligned layout: token i's slot; parents then per slot


class BatchUnavailable(GenerationError):
    """This decoder cannot run batched (no rowwise or static KV layout, no gated batched graph of
    it in its entry, or rows not exact on this machine)."""


class Cache(Protocol):
    """A request's KV cache, whatever its layout (Driver.new_cache): ``length`` committed positions."""

    length: int

    def commit(self, present: list[np.ndarray] | None, n_new: int, keep: list[int]) -> None:
        """Keep the past plus this step's rows ``keep`` (indices into its ``n_new`` rows, in path order)."""

    def truncate(self, length: int) -> None: ...

    def ensure(self, positions: int) -> None:
        """Room for ``positions`` before a forward that needs it."""

    def release(self) -> None:
        """Hand in-place buffers back to the driver for the next request."""


class Host(Protocol):
    """What a driver reads of the decoder that holds it (runtime.decoder.Decoder, which imports the
    layouts): the session, its contract and KV names, the embedder, and how a lone token is run."""

    s: Any  # the onnxruntime InferenceSession
    c: S.Contract
    kv_in: list[str]
    kv_out: list[str]
    out_names: list[str]
    has_hidden: bool
    pad_single: bool
    prefill_s: Any  # the prefill graph's session (Layout.prefill_pass), or None

    @property
    def single_rows(self) -> int: ...

    def embeddings(self, ids: np.ndarray) -> np.ndarray: ...

    def new_cache(self) -> Any: ...

    def prefill(
        self, tokens: Sequence[int], kv: Any, prompt: int, room: int, embeds: np.ndarray | None = None
    ) -> Out: ...


def bind_kv(binding: Any, kv_in: list[str], kv_out: list[str], buffers: np.ndarray) -> None:
    """Bind each layer's K or V buffer (``buffers[j]``) as both its past input and its present
    output: an in-place graph writes the step's rows into the memory it reads."""
    import onnxruntime as ort

    for j, (i_name, o_name) in enumerate(zip(kv_in, kv_out)):
        v = ort.OrtValue.ortvalue_from_numpy(buffers[j])
        binding.bind_ortvalue_input(i_name, v)
        binding.bind_ortvalue_output(o_name, v)


def check_room(kv: Any, rows: int) -> None:
    """Refuse a step whose rows would not fit an in-place cache's capacity."""
    if kv.length + rows > kv.capacity:
        raise GenerationError(
            f"the KV cache holds {kv.capacity} positions and this step needs {kv.length + rows}: "
            f"use a shorter prompt or fewer new tokens, or rebuild with a larger --max-context"
        )


class Driver:
    """One layout's graph driven for one request: the layout module's subclass makes the cache
    (``new_cache``) and feeds a step (``forward``); the gates' explicit form (``forward_past``,
    through build.runner) shares the feeds here, a layout adapting the past (``past_feeds``).
    What the subclasses share also lives here: timed runs (``last_run_s``), a reused output array,
    and the released in-place buffers that the next request's cache reuses (``free``)."""

    one_row = False  # a lone token is one graph row on any graph of the layout, and trees come as chains
    sparse = False  # rows decoupled from attention slots (static: the graph takes SLOT_ROWS / ROW_SLOTS)

    def __init__(self, dec: Host):
        self.dec = dec
        self.c = dec.c
        self.kv_in, self.kv_out = dec.kv_in, dec.kv_out
        self.last_run_s = 0.0  # seconds inside onnxruntime's run in the last forward
        # released in-place buffers (StaticKV's buffer or GrowingKV's memory) with their IOBinding
        self.free: list[tuple[np.ndarray, Any]] = []
        self._out_buf = np.zeros(0, dtype=np.float32)
        self._arange = np.zeros(0, dtype=np.int64)
        # an in-place graph slices its lm-head's rows (export.passes.common.slice_logits): it must be
        # fed LOGITS_FROM on every run (0: all rows); older builds and concat graphs have no such input
        self.logits_from = S.LOGITS_FROM in {i.name for i in dec.s.get_inputs()}

    def logits_start(self, rows: int, last: int | None) -> int:
        """The first of a step's ``rows`` graph rows whose logits it returns: 0 (all) unless ``last``
        asks for the last rows only and the graph can slice. Never fewer rows than a lone token's
        step runs (single_rows), so the lm-head takes the rows' path a decode step takes (rows are
        row-invariant from there: the per-op probe and the row guard see to it)."""
        if last is None or not self.logits_from:
            return 0
        return max(0, rows - max(last, self.dec.single_rows))

    # ------------------------------------------------------------------ what each layout defines
    def new_cache(self) -> Cache:
        raise NotImplementedError

    def forward(
        self,
        tokens: Sequence[int],
        parents: list[int] | None,
        kv: Cache,
        embeds: np.ndarray | None = None,
        copy: bool = True,
        slots: Sequence[int] | None = None,
        last: int | None = None,
    ) -> Out:
        """runtime.decoder.Decoder.forward, on this layout."""
        raise NotImplementedError

    def prefill(
        self, tokens: Sequence[int], kv: Cache, prompt: int, room: int, embeds: np.ndarray | None = None
    ) -> Out:
        """runtime.decoder.Decoder.prefill: a prompt chunk as a chain step on the decode graph."""
        return self.forward(tokens, None, kv, None if embeds is None else embeds[None], copy=False, last=1)

    def empty_past(self) -> dict[str, np.ndarray]:
        """The past of an empty context as the gates pass it (``forward_past``): zero rows."""
        c = self.c
        z = np.zeros((1, c.num_kv_heads, 0, c.head_dim), dtype=np.float32)
        return dict.fromkeys(self.kv_in, z)

    def past_feeds(
        self, past: dict[str, np.ndarray], bias: np.ndarray, rows: int
    ) -> tuple[dict[str, np.ndarray], np.ndarray, int | None]:
        """The gates' past arrays and mask (past + new wide) as this layout's graph takes them, and
        how many positions of its present to give back (None: all)."""
        return dict(past), bias, None

    # ------------------------------------------------------------------ shared
    def forward_past(
        self, ids: np.ndarray, pos: np.ndarray, bias: np.ndarray, past: dict[str, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """The gates' form (build.runner): explicit positions, additive mask and past arrays in;
        this step's logits, hidden states and present (as the next step's past) out."""
        c = self.c
        feeds, bias, keep = self.past_feeds(past, bias, len(ids))
        if self.logits_from:
            feeds[S.LOGITS_FROM] = np.zeros(1, np.int64)  # every row
        if c.primary_input == S.INPUTS_EMBEDS:
            feeds[S.INPUTS_EMBEDS] = self.dec.embeddings(ids[None])
        else:
            feeds[S.INPUT_IDS] = ids[None].astype(np.int64)
        feeds[S.POSITION_IDS] = pos
        feeds[S.ATTENTION_BIAS] = bias
        if self.sparse:
            feeds[S.SLOT_ROWS] = feeds[S.ROW_SLOTS] = np.arange(len(ids), dtype=np.int64)
        out = dict(zip(self.dec.out_names, self.run(None, feeds)))
        present = {i: out[o][:, :, :keep] for i, o in zip(self.kv_in, self.kv_out)}
        return out[S.LOGITS][0], out.get(S.HIDDEN_STATES, np.zeros((1, 0)))[0], present

    def reclaim(self, buffers: np.ndarray, binding: Any) -> None:
        """Take back a released cache's buffers and their IOBinding (StaticKV.release): the next
        new_cache reuses them instead of mapping a capacity's worth of fresh memory."""
        self.free.append((buffers, binding))

    def run(self, names: list[str] | None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        t0 = time.perf_counter()
        out = self.dec.s.run(names, feeds)
        self.last_run_s = time.perf_counter() - t0
        return out

    def run_bound(self, binding: Any, session: Any = None) -> None:
        """Run ``binding`` on ``session`` (default: the decode graph's), timed into ``last_run_s``."""
        t0 = time.perf_counter()
        (self.dec.s if session is None else session).run_with_iobinding(binding)
        self.last_run_s = time.perf_counter() - t0

    def outputs(self, rows: int, start: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
        """Logits [1, rows - start, V] and hidden states [1, rows, H] (None without them) as views
        of one reused array: a long prompt's chunks do not fault in fresh pages every chunk."""
        V, H = self.c.vocab_size, (self.c.hidden_size if self.dec.has_hidden else 0)
        lv = (rows - start) * V
        need = lv + rows * H
        if self._out_buf.size < need:
            self._out_buf = np.empty(max(need, 2 * self._out_buf.size), dtype=np.float32)
        logits = self._out_buf[:lv].reshape(1, rows - start, V)
        return logits, (self._out_buf[lv:need].reshape(1, rows, H) if self.dec.has_hidden else None)

    def identity(self, m: int) -> np.ndarray:
        if len(self._arange) < m:
            self._arange = np.arange(max(m, 2 * len(self._arange)), dtype=np.int64)
        return self._arange[:m]


class PaddedDriver(Driver):
    """The feeds concat and static share: a lone token padded to two graph rows (``pad_single``), a
    mask and positions made from ``parents``, a tree's aligned slot layout run slot by slot unless
    the graph takes the slots itself (``sparse``). A layout says where its past is
    (``past_inputs``) and how a step runs (``run_step``).

    Why pad: ORT's kernels take another path for one row (GEMV) than for several, and
    int8-activation kernels amplify that last-bit difference into different argmaxes. With every
    forward on the multi-row path, a token's logits are bit-identical whether it is verified alone
    or in a batch of drafts -- which is what makes speculative decoding exactly equal to plain
    decoding. The pad sits after the real row, which never attends to it, and its output and KV
    are dropped."""

    def __init__(self, dec: Host):
        super().__init__(dec)
        c = self.c
        # the 4D additive mask's input (trees and chains); None: a 2D padding mask or none
        self.bias_input = c.mask_input if c.mask_kind == S.MASK_ADDITIVE_4D else None

    def past_inputs(self, kv: Any) -> dict[str, np.ndarray]:
        """The step's past feeds (a bound in-place buffer: none)."""
        raise NotImplementedError

    def run_step(
        self, feeds: dict[str, np.ndarray], kv: Any, n: int, m: int, rows: int, copy: bool, pad: bool, start: int
    ) -> Out:
        """Run the step's ``feeds``: ``n`` tokens, ``m`` attention slots, ``rows`` graph rows,
        logits from row ``start`` on."""
        raise NotImplementedError

    def forward(
        self,
        tokens: Sequence[int],
        parents: list[int] | None,
        kv: Cache,
        embeds: np.ndarray | None = None,
        copy: bool = True,
        slots: Sequence[int] | None = None,
        last: int | None = None,
    ) -> Out:
        dec, c = self.dec, self.c
        if slots is not None and parents is None:
            raise GenerationError("a slot layout needs its parents per slot (pads: -1)")
        if slots is not None and not self.sparse:
            assert parents is not None
            slots = list(slots)
            logits, hidden, present = self.forward(
                slot_tokens(list(tokens), slots, len(parents)), parents, kv, embeds, copy=copy
            )
            return logits[slots], (hidden[slots] if hidden is not None else None), present
        n = len(tokens)
        past = kv.length
        pad = n == 1 and dec.pad_single
        toks = np.asarray(list(tokens) * 2 if pad else tokens, dtype=np.int64)
        if pad:
            parents = [-1, -1]
            if embeds is not None:
                embeds = np.concatenate([embeds, embeds], axis=1)
        feeds = self.past_inputs(kv)
        if c.primary_input == S.INPUTS_EMBEDS:
            feeds[S.INPUTS_EMBEDS] = embeds if embeds is not None else dec.embeddings(toks[None])
        else:
            feeds[S.INPUT_IDS] = toks[None]
        m = (
            len(parents) if slots is not None and parents is not None else len(toks)
        )  # attention slots (graph rows if dense)
        if self.bias_input is not None:
            pos, bias = causal_inputs(m, past) if parents is None else step_inputs(parents, past)
            feeds[self.bias_input] = bias
        else:
            if parents is not None and parents != list(range(-1, m - 1)) and not pad:
                raise GenerationError("this decoder has no 4D mask input: it can verify chains only")
            pos = np.arange(past, past + m, dtype=np.int64)[None]
            if c.mask_input:
                feeds[c.mask_input] = np.ones((1, past + m), dtype=np.int64)
        if c.position_input:
            feeds[c.position_input] = pos
        if self.sparse:
            if slots is None:
                feeds[S.SLOT_ROWS] = feeds[S.ROW_SLOTS] = self.identity(m)
            else:
                slot_rows = np.zeros(m, np.int64)
                slot_rows[list(slots)] = np.arange(n)
                feeds[S.SLOT_ROWS], feeds[S.ROW_SLOTS] = slot_rows, np.asarray(slots, np.int64)
        start = 0 if slots is not None else self.logits_start(len(toks), last)  # a padded lone row: 0
        if self.logits_from:  # always fed: an in-place cache's binding keeps what it was last given
            feeds[S.LOGITS_FROM] = np.array([start], np.int64)
        return self.run_step(feeds, kv, n, m, len(toks), copy, pad, start)


Owner = TypeVar("Owner")  # what holds a batch slot (the scheduler's Request); opaque here


class BatchDriver(Generic[Owner]):
    """A layout's batched serving graph, its KV buffer and the slot of every active request: the
    interface the scheduler and serve.batch.measure_exact drive every layout's batch through
    (acquire, release, forward, commit, lengths, capacity, single_rows, last_run_s). The active
    requests' rows are a contiguous prefix of the slots, ``buf[:, slot]`` each, bound in place.
    A layout's subclass makes ``buf`` and feeds a step (``forward``)."""

    buf: np.ndarray  # [2 * layers, max_batch, kv_heads, length, head_dim]

    def __init__(self, decoder: Host, path: Path, max_batch: int, threads: int):
        """``decoder``: the variant ``path`` (its batched flavour) was made from."""
        import onnxruntime as ort

        from ..runtime.session import make_session

        c = decoder.c
        if c.mask_input is None:
            raise BatchUnavailable("the decoder has no mask input: batched serving needs a 4D mask")
        self.ort = ort
        self.decoder = decoder
        self.c = c
        self.mask_input: str = c.mask_input
        self.s = make_session(path, threads)
        self.max_batch = max_batch
        self.capacity = c.kv_capacity
        self.single_rows = decoder.single_rows  # graph rows a lone token costs (Job.single_rows)
        self.kv_in, self.kv_out = decoder.kv_in, decoder.kv_out
        self.lengths = [0] * max_batch
        self.active = 0  # slots [0, active) are in use
        self.owners: list[Owner | None] = [None] * max_batch
        self._bindings: dict[tuple[int, int], Any] = {}  # onnxruntime IOBindings per slot range
        self.last_run_s = 0.0
        self.split_forwards = 0  # steps whose entries did not fit one padded forward (layouts.static)
        self._prefilling: dict[int, Any] = {}  # slot -> its prompt's own cache while it prefills (prefill)

    def forward(self, lo: int, rows: Sequence[Rows | None]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """One forward over slots ``lo .. lo+len(rows)``; ``None`` marks an idle slot. Returns per
        slot (logits [n, V], hidden [n, H] or None) for its real rows (n = 0 for an idle slot), and
        commits nothing: the caller moves each slot's length with :meth:`commit`."""
        raise NotImplementedError

    def prefill(self, slot: int, rows: Rows, prompt: int, room: int) -> tuple[np.ndarray, np.ndarray | None]:
        """One chunk of ``slot``'s ``prompt``-token prompt, run exactly as a request alone runs it
        (``Decoder.prefill`` of the decoder this graph was made from, over a cache of the slot's own:
        the same chunks, the same graph -- a rowwise variant's prefill graph included -- so the same
        bits, and the lm-head on the chunk's last row only, where the batched graph would compute
        every row's), then its rows' K/V copied into the slot (~3 MB per 64 rows on SmolLM2-135M)
        for the caller's :meth:`commit`. Returns the chunk's last-row logits and its hidden states."""
        dec = self.decoder
        kv = self._prefilling.get(slot)
        if kv is None:
            kv = self._prefilling[slot] = dec.new_cache()
        past, n = kv.length, len(rows.tokens)
        if past != self.lengths[slot]:
            raise GenerationError(f"slot {slot} holds {self.lengths[slot]} positions, its prefill {past}")
        logits, hidden, present = dec.prefill(rows.tokens, kv, prompt, room, rows.embeds)
        kv.commit(present, n, list(range(n)))
        self.fit(past + n)
        self.buf[:, slot, :, past : past + n] = kv.buffers()[:, 0, :, past : past + n]
        if kv.length >= prompt:
            self._prefilling.pop(slot).release()
        return logits, hidden

    def fit(self, positions: int) -> None:
        """Make the slots' buffer hold ``positions`` (a fixed-capacity buffer already does)."""

    # ------------------------------------------------------------------ slots
    def acquire(self, owner: Owner | None) -> int:
        if self.active >= self.max_batch:
            raise GenerationError("no free batch slot")
        i = self.active
        self.active += 1
        self.owners[i], self.lengths[i] = owner, 0
        return i

    def release(self, slot: int) -> Owner | None:
        """Free ``slot``; the last active request moves into it (its KV rows copied) so the active
        slots stay a contiguous prefix. Returns the owner that moved, whose slot is now ``slot``."""
        pending = self._prefilling.pop(slot, None)
        if pending is not None:  # a request that leaves during its prefill
            pending.release()
        last = self.active - 1
        if last in self._prefilling:  # the last slot's request moves into ``slot``
            self._prefilling[slot] = self._prefilling.pop(last)
        moved = None
        if slot != last:
            n = self.lengths[last]
            self.buf[:, slot, :, :n] = self.buf[:, last, :, :n]
            self.lengths[slot] = n
            moved = self.owners[slot] = self.owners[last]
        self.owners[last] = None
        self.lengths[last] = 0
        self.active -= 1
        return moved

    def commit(self, slot: int, n_rows: int, keep: list[int]) -> None:
        """Keep this step's rows ``keep`` of ``slot`` (as StaticKV.commit)."""
        L = self.lengths[slot]
        k = len(keep)
        if keep != list(range(k)):
            src = L + np.asarray(keep, dtype=np.int64)
            rows = self.buf[:, slot]  # a view: [2 * layers, kv_heads, length, head_dim]
            rows[:, :, L : L + k] = rows[:, :, src]
        self.lengths[slot] = L + k

    def binding(self, lo: int, hi: int) -> Any:
        """The IOBinding of slots ``lo .. hi``, their KV bound as both past and present."""
        key = (lo, hi)
        b = self._bindings.get(key)
        if b is None:
            b = self.s.io_binding()
            bind_kv(b, self.kv_in, self.kv_out, self.buf[:, lo:hi])
            self._bindings[key] = b
        return b

    def run_bound(self, binding: Any) -> None:
        t0 = time.perf_counter()
        self.s.run_with_iobinding(binding)
        self.last_run_s = time.perf_counter() - t0

    def bind_outputs(self, binding: Any, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray | None]:
        """Fresh logits [*shape, V] and hidden states [*shape, H] (None without them), bound as outputs."""
        logits = np.empty((*shape, self.c.vocab_size), np.float32)
        binding.bind_ortvalue_output(S.LOGITS, self.ort.OrtValue.ortvalue_from_numpy(logits))
        hidden = None
        if self.c.hidden_output is not None:
            hidden = np.empty((*shape, self.c.hidden_size), np.float32)
            binding.bind_ortvalue_output(self.c.hidden_output, self.ort.OrtValue.ortvalue_from_numpy(hidden))
        return logits, hidden

    def embeddings(self, r: Rows) -> np.ndarray:
        """A request's rows' embeddings [n, H]: its own, else the decoder's embedder's."""
        if r.embeds is not None:
            return r.embeds
        return self.decoder.embeddings(np.asarray(r.tokens, np.int64)[None])[0]
