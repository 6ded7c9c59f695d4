"""A loaded decoder: the Python API (`load`, `Model.generate`, `Model.stream`).

A Model may be shared between threads: its calls run one at a time (its decoder reuses buffers
and bindings between steps), so each thread gets exactly the answer it would get alone. Load a
Model per thread to decode in parallel."""

from __future__ import annotations

import atexit
import json
import os
import queue
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generator, Sequence

import numpy as np

from .. import schema as S
from ..cache import (
    cache_root,
    is_path_like,
    locate,
    member,
    no_manifest,
    read_checked_contract,
    read_checked_manifest,
    read_entry,
    rebuild_hint,
    verify_entry,
)
from ..errors import CacheError, DejavuuError, GenerationError, IntegrityError
from ..log import logger
from .decoder import Decoder
from .drafters.base import DraftBudget, Drafter
from .engine import Engine
from .job import GenerationStats, StopFn, Successors
from .sampling import Sampler
from .session import cross_check, derive_contract, make_session
from .settings import DecodeSettings
from .stops import StopStream, cut, stop_fn
from .tokenizer import IncrementalDecoder, TextTokenizer

if TYPE_CHECKING:
    from .calibration import Calibration
    from .vision import VisionParts


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(threads: int | None) -> int:
    """ORT intra-op threads: 1 to this machine's CPU count (more only oversubscribes, and
    thousands never finish starting). None: DEJAVUU_THREADS, else schema.DEFAULT_THREADS, capped
    at the CPU count."""
    n = cpu_count()
    if threads is None:
        env = os.environ.get("DEJAVUU_THREADS")
        if env is None:
            return min(S.DEFAULT_THREADS, n)
        try:
            threads = int(env)
        except ValueError:
            raise DejavuuError(f"DEJAVUU_THREADS={env!r} is not a number: set it to 1..{n}") from None
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= n:
        raise DejavuuError(f"threads must be between 1 and {n} (this machine's CPU count), got {threads!r}")
    return threads


def check_text(text: str, what: str = "the prompt") -> str:
    """``text`` if it encodes as UTF-8 (a lone surrogate does not), else one line naming ``what``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise GenerationError(f"{what} is not valid UTF-8 text: pass text in UTF-8") from None
    return text


def _integer(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_ids(prompt, vocab_size: int | None) -> list[int]:
    """A 1-D sequence of integer token ids inside the vocabulary (an id past it would be decoded
    from whatever the embedding gather reads, or wrap around when negative)."""
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or not (np.issubdtype(prompt.dtype, np.integer) or prompt.size == 0):
            raise GenerationError(
                f"token ids must be a 1-D array of integers, got a {prompt.ndim}-D {prompt.dtype} "
                f"array: pass one prompt's ids"
            )
        prompt = prompt.tolist()
    ids = []
    for i, t in enumerate(prompt):
        if not _integer(t):
            raise GenerationError(
                f"token ids must be integers, but item {i} is {str(repr(t))[:40]}: pass one "
                f"prompt as a flat list of ids"
            )
        if t < 0 or (vocab_size and t >= vocab_size):
            raise GenerationError(
                f"token id {t} (item {i}) is outside this model's vocabulary "
                f"[0, {vocab_size or '?'}): pass ids the tokenizer gives"
            )
        ids.append(int(t))
    return ids


def _check_messages(messages) -> list[dict]:
    """Chat messages: dicts with a string role and a string (or, for VLMs, list) content."""
    for i, msg in enumerate(messages):
        if (
            not isinstance(msg, dict)
            or not isinstance(msg.get("role"), str)
            or not isinstance(msg.get("content"), (str, list))
        ):
            raise GenerationError(
                f"chat message {i} is {str(repr(msg))[:60]}: every message must be a dict with "
                f"a string 'role' and a string 'content'"
            )
        if isinstance(msg["content"], str):
            check_text(msg["content"], "a chat message")
    return list(messages)


class _StreamClosed(Exception):
    """Raised inside a stream's worker once its consumer has stopped reading."""


_LIVE_STREAMS: "weakref.WeakSet" = weakref.WeakSet()
_MODELS: "weakref.WeakValueDictionary[int, Model]" = weakref.WeakValueDictionary()


def _after_fork_in_child() -> None:
    """A forked child has only the thread that forked: a Model's lock held by another thread would
    never be released there. Each Model gets a fresh lock; one that was generating at the fork is
    refused with a clear line (its decoder stopped mid-step), an idle one works as before."""
    for m in list(_MODELS.values()):
        m._forked_mid_run = m._forked_mid_run or m._owner is not None
        m._lock = threading.Lock()
        m._owner = None
    _LIVE_STREAMS.clear()  # their threads did not come along


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _stop_streams() -> None:
    """A stream still open when the interpreter exits is stopped and waited for: a worker killed
    inside onnxruntime's run aborts the process ("terminate called without an active exception")."""
    for st in list(_LIVE_STREAMS):
        st.stop()


class _StreamWorker:
    def __init__(self, target):
        self.closed = threading.Event()
        self.thread = threading.Thread(target=target, name="dejavuu-stream", daemon=True)

    def stop(self, timeout: float = 60.0) -> None:
        self.closed.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_tokens: int
    stats: GenerationStats
    stop_reason: str
    method: str = "baseline"
    tree: bool = False

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "stop_reason": self.stop_reason,
            "method": self.method,
            "tree": self.tree,
            "stats": self.stats.to_json(),
        }


@dataclass
class RequestPlan:
    """One request's decoding set-up (`Model.plan`)."""

    sampler: Sampler
    drafter: Drafter
    budget: DraftBudget
    tree: bool
    period: int | None
    tile: int | None
    should_stop: StopFn | None
    fill: Successors | None


@dataclass
class Model:
    folder: Path
    variant: str
    decoder: Decoder
    contract: S.Contract
    tokenizer: TextTokenizer | None
    eos_ids: list[int] = field(default_factory=list)
    manifest: S.Manifest | None = None
    vision: VisionParts | None = None  # VLM builds' vision encoder and image splicing
    path: Path | None = None  # the .onnx file its decoder opened
    _warned_tree: bool = False
    _calibration: Calibration | None = None  # measured on first use
    _warned_exact: bool = False
    # empty drafts verify a successor guess: in the pad row where there is one (free), else in a
    # row of its own while it pays (job.FillPolicy)
    fill: bool = True
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _owner: int | None = field(default=None, repr=False, compare=False)
    # set in a forked child when a generation was running in another thread at the fork
    _forked_mid_run: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self):
        _MODELS[id(self)] = self

    @contextmanager
    def _exclusive(self, reentrant: bool = False):
        """One generation (or calibration) at a time on this Model: its decoder reuses output
        buffers, bindings and KV memory between calls, so two at once would read each other's.
        Other threads wait their turn; a generate from inside this Model's own callback is refused."""
        if self._forked_mid_run:
            raise GenerationError(
                "this process was forked while this Model was generating in another thread, so its "
                "decoder stopped mid-step: load the model again in this process (or fork while it is idle)"
            )
        me = threading.get_ident()
        if self._owner == me:
            if not reentrant:
                raise GenerationError(
                    "generate was called from inside a callback of a generate on the same Model: "
                    "finish that call first, or load a second Model"
                )
            yield  # the calibration inside generate's plan: already held
            return
        with self._lock:
            self._owner = me
            try:
                yield
            finally:
                self._owner = None

    @property
    def tree_capable(self) -> bool:
        return self.contract.tree_capable

    # ------------------------------------------------------------------ prompts
    def encode(self, prompt) -> list[int]:
        """Token ids of a prompt (text, chat messages or ids), each refused with one line when bad."""
        if isinstance(prompt, (list, tuple)) and any(isinstance(m, dict) for m in prompt):
            if self.tokenizer is None:
                raise GenerationError("this model has no tokenizer: pass token ids")
            ids = self.tokenizer.encode_chat(_check_messages(prompt))
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise GenerationError("this model has no tokenizer: pass token ids")
            if not prompt.strip():
                raise GenerationError("the prompt is empty: give some text")
            ids = self.tokenizer.encode(check_text(prompt))
        elif isinstance(prompt, (list, tuple)) and any(isinstance(t, str) for t in prompt):
            raise GenerationError(
                "prompt must be a string, a list of chat messages (dicts) or a list of token ids; "
                "got a list holding text: pass the text as one string"
            )
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = _check_ids(prompt, self.contract.vocab_size)
        else:
            raise GenerationError("prompt must be a string, a list of chat messages or a list of token ids")
        if not ids:
            raise GenerationError("the prompt is empty: give some text")
        return ids

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompt,
        settings: DecodeSettings | None = None,
        *,
        method: str | Drafter = "baseline",
        tree: bool = False,
        max_new_tokens: int = S.DEFAULT_MAX_NEW_TOKENS,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        stop: Sequence[str] = (),
        datastore=None,
        width: int = S.DEFAULT_TREE_WIDTH,
        max_nodes: int | None = None,
        max_depth: int = S.DEFAULT_MAX_DEPTH,
        on_tokens=None,
        validate_drafts: bool = False,
        residual_fn=None,
        images: Sequence | None = None,
        prefill_embeds: np.ndarray | None = None,
        **drafter_params,
    ) -> GenerationResult:
        """Decode ``prompt`` (text, chat messages or token ids) under ``settings``: a
        :class:`DecodeSettings`, or its fields as keyword arguments (``method`` ... ``max_depth``;
        not both). ``prefill_embeds``: the prompt ids' embeddings with image features already
        spliced in (``vision.prefill``), for callers that prepared them once (the server)."""
        s = DecodeSettings.given(
            settings,
            dict(
                method=method,
                tree=tree,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed,
                stop=stop,
                width=width,
                max_nodes=max_nodes,
                max_depth=max_depth,
            ),
        )
        with self._exclusive():
            return self._generate(
                prompt,
                s,
                datastore=datastore,
                on_tokens=on_tokens,
                validate_drafts=validate_drafts,
                residual_fn=residual_fn,
                images=images,
                prefill_embeds=prefill_embeds,
                drafter_params=drafter_params,
            )

    def _generate(
        self,
        prompt,
        s: DecodeSettings,
        *,
        datastore,
        on_tokens,
        validate_drafts,
        residual_fn,
        images,
        prefill_embeds,
        drafter_params,
    ) -> GenerationResult:
        if images:
            if self.vision is None:
                raise GenerationError(f"{self.folder.name} takes no images: build a VLM with `dejavuu-build vlm`")
            if isinstance(prompt, str) and not prompt.strip():
                raise GenerationError("the prompt is empty: give some text")
            ids, prefill_embeds = self.vision.prefill(prompt, images, self.tokenizer, self.decoder.embed)
        else:
            ids = self.encode(prompt)
            if prefill_embeds is not None and prefill_embeds.shape[:2] != (1, len(ids)):
                raise GenerationError(
                    f"prefill_embeds must be [1, {len(ids)}, hidden] for this prompt, got {list(prefill_embeds.shape)}"
                )
        max_new_tokens = s.max_new_tokens
        limit = self.contract.max_positions
        if limit and len(ids) + max_new_tokens > limit:
            raise GenerationError(
                f"prompt ({len(ids)} tokens{', images included' if images else ''}) + max_new_tokens "
                f"({max_new_tokens}) exceeds the model's {limit} positions: shorten the prompt, "
                f"use fewer images or lower max_new_tokens"
            )
        plan = self.plan(s, datastore=datastore, drafter_params=drafter_params)
        engine = Engine(
            self.decoder, tree_capable=self.tree_capable, period=plan.period, tile=plan.tile, fill=plan.fill
        )
        new, stats, reason = engine.generate(
            ids,
            drafter=plan.drafter,
            sampler=plan.sampler,
            max_new_tokens=max_new_tokens,
            tree=plan.tree,
            budget=plan.budget,
            eos_ids=self.eos_ids,
            should_stop=plan.should_stop,
            on_tokens=on_tokens,
            validate_drafts=validate_drafts,
            prefill_embeds=prefill_embeds,
            **({"residual_fn": residual_fn} if residual_fn else {}),
        )
        text = cut(self.tokenizer.decode(new), s.stop) if self.tokenizer else ""
        return GenerationResult(text, new, len(ids), stats, reason, s.method_name, plan.tree)

    def plan(self, settings: DecodeSettings, *, datastore=None, drafter_params: dict | None = None) -> "RequestPlan":
        """How one request decodes on this machine: its sampler, drafter, draft budget and the
        exactness fallbacks (chains when the CPU has no exact tree layout, plain steps when a batched
        verify is not bit-identical), each announced once. `generate` and the server's scheduler
        both start from it, so a served request decodes exactly as the same `generate` call."""
        s = settings
        sampler = s.sampler
        drafter = self._drafter(s.method, datastore, dict(drafter_params or {}), sampler)
        if s.tree and not self.tree_capable and not self._warned_tree:
            logger.warning(
                "this decoder has no 4D attention mask input (%s): tree mode is off, verifying chains",
                self.contract.mask_kind,
            )
            self._warned_tree = True
        use_tree = s.tree and self.tree_capable
        if use_tree and self.tree_period is None:
            if not self._warned_tree:
                logger.warning(
                    "%s: "
                    + (
                        "a rowwise variant verifies chains only (its one-row attention cannot give "
                        "tree nodes their chain's arithmetic; the -static variant can)"
                        if self.decoder.rowwise
                        else "this CPU's attention kernel showed no key-block period under which tree "
                        "rows are bit-identical to chains"
                    )
                    + ": verifying chains to stay lossless",
                    self.variant,
                )
                self._warned_tree = True
            use_tree = False
        budget = DraftBudget(
            max_nodes=s.max_nodes or (16 if use_tree else s.max_depth),
            max_depth=s.max_depth,
            width=s.width if use_tree else 1,
            tree=use_tree,
        )
        # plain decoding (by name, or the bare Drafter the bench passes) never drafts nor fills
        speculative = (
            s.method not in ("baseline", "baseline_n1") if isinstance(s.method, str) else type(s.method) is not Drafter
        )
        if speculative and not self.calibration.chain_exact:
            if not self._warned_exact:
                logger.warning(
                    "on this machine a batched verify is not bit-identical to single steps: decoding "
                    "plainly (exact, without drafts) instead of speculatively"
                )
                self._warned_exact = True
            budget = DraftBudget(max_nodes=1, max_depth=0, width=1, tree=False)
            use_tree = False
        return RequestPlan(
            sampler=sampler,
            drafter=drafter,
            budget=budget,
            tree=use_tree,
            period=self.tree_period if use_tree else None,
            tile=self.calibration.tile if use_tree else None,
            should_stop=stop_fn(self.tokenizer, s.stop) if s.stop else None,
            fill=Successors() if speculative and self.fill and budget.max_depth > 0 else None,
        )

    @property
    def calibration(self) -> Calibration:
        """Measured once per machine, onnxruntime, graph and thread count (runtime.calibration)."""
        if self._calibration is None:
            with self._exclusive(reentrant=True):  # it runs the decoder
                if self._calibration is None:
                    self._calibration = _calibration(self)
                    logger.debug("exactness calibration: %s", self._calibration)
        return self._calibration

    @property
    def tree_period(self) -> int | None:
        return self.calibration.period if self.tree_capable else None

    def stream(self, prompt, settings: DecodeSettings | None = None, **kw) -> Generator[str, None, None]:
        """Yield text pieces as tokens are committed (a chunk per verify step); the pieces join to
        ``generate(...).text``. Text is decoded incrementally (a short window per step), and with stop
        strings the last few characters are held back until they cannot begin one. When the consumer
        stops (``break``, ``close()``, an error in its loop) the decoding stops at its next step and is
        waited for, so the Model is ready for the next call. ``settings`` and ``kw`` as for
        ``generate``."""
        if self.tokenizer is None:
            raise GenerationError("this model has no tokenizer: use generate() with token ids")
        loose, kw = DecodeSettings.split(kw)
        settings = DecodeSettings.given(settings, loose)
        text = StopStream(list(settings.stop))
        q: queue.Queue = queue.Queue()
        done = object()
        err: list[BaseException] = []
        dec = IncrementalDecoder(self.tokenizer)

        def on_tokens(new):
            if worker.closed.is_set():
                raise _StreamClosed()
            if piece := dec.push(new):
                q.put(piece)

        def run():
            try:
                self.generate(prompt, settings, on_tokens=on_tokens, **kw)
                if piece := dec.flush():
                    q.put(piece)
            except _StreamClosed:
                pass
            except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
                err.append(e)
            finally:
                q.put(done)

        worker = _StreamWorker(run)
        _LIVE_STREAMS.add(worker)
        worker.thread.start()
        try:
            while (item := q.get()) is not done:
                if ready := text.push(item):  # (nothing once a stop string was met: the rest drains)
                    yield ready
        finally:  # the consumer stopped (or finished): stop the worker and wait for it
            worker.stop()
            _LIVE_STREAMS.discard(worker)
        if err:
            raise err[0]
        if rest := text.finish():
            yield rest

    def _drafter(self, method, datastore, params, sampler: Sampler) -> Drafter:
        if isinstance(method, Drafter):
            return method
        if method == "draft_model":
            from .model_drafter import ModelDrafter

            dm = params.pop("draft_model", None)
            if dm is None:
                raise GenerationError("method draft_model needs draft_model=NAME[:VARIANT] (a build in the cache)")
            if not isinstance(dm, (str, Model)):
                raise GenerationError(
                    f"draft_model must be NAME[:VARIANT] (a build in the cache) or a loaded Model, "
                    f"got {str(repr(dm))[:40]}"
                )
            if isinstance(dm, str):
                name, colon, variant = dm.partition(":")
                if colon and not variant:
                    raise GenerationError(f"draft_model {dm!r} names no variant after ':': pass NAME or NAME:VARIANT")
                dm = load(name, variant=variant or None)
            if dm.decoder is self.decoder:  # one decoder's buffers cannot hold both models' steps
                raise GenerationError("the draft model is this Model itself: load it a second time to draft with it")
            if dm.contract.vocab_size != self.contract.vocab_size:
                raise GenerationError("the draft model's vocabulary differs from the target's")
            return ModelDrafter(
                dm,
                temperature=sampler.temperature,
                top_p=sampler.top_p,
                top_k=sampler.top_k,
                seed=sampler.seed,
                **params,
            )
        from .drafters import make_drafter

        if isinstance(datastore, str):
            datastore = load_datastore(datastore)
        try:
            return make_drafter(method, datastore=datastore, **params)
        except (TypeError, ValueError) as e:
            raise GenerationError(f"method {method}: {e}") from None


def _calibration(model: "Model") -> Calibration:
    """The machine-local exactness calibration of this model's graph (runtime.calibration)."""
    from .calibration import cached_calibration

    graph_id = (
        model.manifest.variants[model.variant].sha256
        if model.manifest and model.variant in model.manifest.variants
        else f"{model.folder}/{model.variant}"
    )
    threads = model.decoder.s.get_session_options().intra_op_num_threads
    return cached_calibration(model.decoder, graph_id, threads, cache_root() / S.RUNTIME_DIR)


def load_datastore(name_or_path: str):
    from .drafters.datastore import Datastore

    folder = locate(name_or_path)

    def read(folder: Path):
        if not folder.is_dir():
            raise CacheError(
                f"no datastore {str(name_or_path)!r}; build it with `dejavuu-build datastore --from FILE "
                f"--tokenizer MODEL --name {folder.name}`"
            )
        m = verify_entry(folder)
        if m.kind != S.KIND_DATASTORE:
            raise CacheError(
                f"{str(name_or_path)!r} is a {m.kind} build, not a datastore: pass a datastore's name "
                f"(build one with `dejavuu-build datastore --from FILE --tokenizer MODEL --name NAME`)"
            )
        return Datastore.load(folder)

    return read_entry(folder, read)


def _target(name_or_path: str | os.PathLike) -> tuple[Path, Path | None]:
    """(folder, explicit .onnx file or None), without looking at the disk: a bare word is a cache
    name (a same-named folder here never shadows it), anything path-like is that path."""
    if not is_path_like(name_or_path):
        return locate(str(name_or_path)), None
    p = Path(name_or_path).expanduser()
    if p.suffix == ".onnx":
        return p.parent, p
    return p, None


def _check_target(folder: Path, onnx_file: Path | None, name_or_path) -> None:
    if onnx_file is not None:
        if not onnx_file.is_file():
            raise CacheError(f"{onnx_file} not found")
        return
    if folder.is_dir():
        return
    if not is_path_like(name_or_path):
        here = (
            f"; the folder ./{name_or_path} here is not looked at: pass ./{name_or_path} to load it"
            if Path(str(name_or_path)).is_dir()
            else ""
        )
        raise CacheError(
            f"no build named {str(name_or_path)!r} in {cache_root()}; build it with "
            f"`dejavuu-build tree-decoder --name {name_or_path}` (and --model ...){here}"
        )
    raise CacheError(f"{folder} is not a folder or an .onnx file")


def resolve_folder(name_or_path: str | os.PathLike) -> tuple[Path, Path | None]:
    """(folder, explicit .onnx file or None) for a cache name, a folder or an .onnx path."""
    folder, onnx_file = _target(name_or_path)
    _check_target(folder, onnx_file, name_or_path)
    return folder, onnx_file


def load(
    name_or_path: str | os.PathLike, *, variant: str | None = None, threads: int | None = None, verify: bool = True
) -> Model:
    """Load a decoder by cache name, folder or .onnx path (the manifest's default variant unless named).

    A bare word is a cache name; a path (``./x``, ``a/b``, ``x.onnx``, a Path) is that path. An
    .onnx file inside a build must be one of its variants. Every file read is verified against the
    manifest, and all of them come from one committed build even while it is being rebuilt."""
    threads = check_threads(threads)
    if variant is not None and (not isinstance(variant, str) or not variant.strip()):
        raise CacheError(
            f"variant must name one of the build's variants (such as int4), got {variant!r}; "
            f"leave it out for the manifest's default"
        )
    folder, onnx_file = _target(name_or_path)
    if onnx_file is not None:
        _check_target(folder, onnx_file, name_or_path)
    return read_entry(folder, lambda f: _load(f, onnx_file, name_or_path, variant, threads, verify))


def _variant_of_file(folder: Path, manifest: S.Manifest, onnx_file: Path, variant: str | None) -> str:
    """The variant whose file ``onnx_file`` is; refuse a file that is none of them, or a mismatch."""
    target = onnx_file.resolve()
    named = next((v for v, r in manifest.variants.items() if member(folder, r.file).resolve() == target), None)
    if named is None:
        raise CacheError(
            f"{onnx_file.name} is not one of {folder.name}'s variants "
            f"({', '.join(f'{v}: {r.file}' for v, r in manifest.variants.items()) or 'none'}); "
            f"pass one of those files, or the folder with --variant"
        )
    if variant is not None and variant != named:
        raise CacheError(f"{onnx_file.name} is the {named} variant, not {variant}: pass one or the other")
    return named


def _load(folder: Path, onnx_file: Path | None, name_or_path, variant: str | None, threads: int, verify: bool) -> Model:
    _check_target(folder, onnx_file, name_or_path)
    manifest = None
    if not (folder / S.MANIFEST_FILE).is_file() and is_ours(folder, name_or_path):
        raise no_manifest(folder)
    if (folder / S.MANIFEST_FILE).is_file():
        manifest = read_checked_manifest(folder)
        if manifest.kind not in S.DECODER_KINDS:
            raise CacheError(
                f"{folder.name} is a {manifest.kind} entry, not a decoder build: pass a decoder's name "
                f"(a datastore goes to --datastore)"
            )
        if onnx_file is not None:
            variant = _variant_of_file(folder, manifest, onnx_file, variant)
        variant = variant or manifest.default_variant
        if variant is None or variant not in manifest.variants:
            raise CacheError(
                f"{folder.name} has no {variant or 'passing default'} variant "
                f"(has: {', '.join(manifest.variants) or 'none'}); build it with "
                f"`dejavuu-build quant-only --name {folder.name}`"
            )
        onnx_path = member(folder, manifest.variants[variant].file)
        if verify:  # every file this load reads: all but the other variants, the build's references
            # and the serving batch graph (serve.batch.open_batch checks that one when it opens it)
            others = {r.file for v, r in manifest.variants.items() if v != variant} | {S.REFERENCE_FILE}
            others |= {
                r.prefill["file"] for v, r in manifest.variants.items() if v != variant and r.prefill.get("file")
            }
            if manifest.batched.get("file"):
                others |= {manifest.batched["file"], manifest.batched["file"] + ".data"}
            verify_entry(folder, skip=others)
        sess = make_session(onnx_path, threads)
        contract = S.variant_contract(read_checked_contract(folder, manifest), manifest.variants[variant])
        cross_check(derive_contract(sess), contract, str(onnx_path))
        prefill = _prefill_session(folder, manifest, variant, threads)
        eos = list(contract.eos_token_ids)
    else:  # a third-party export: the graph is the only contract
        found = onnx_file or next(iter(sorted(folder.glob("*.onnx"))), None)
        if found is None:
            raise CacheError(f"{folder} holds no .onnx decoder")
        onnx_path = found
        sess = make_session(onnx_path, threads)
        prefill = None
        contract = derive_contract(sess)
        variant = onnx_path.stem
        eos = _eos_from_configs(folder)
        contract.eos_token_ids = eos
    embed = vision = None
    if contract.primary_input == S.INPUTS_EMBEDS:
        from .vision import VisionParts, load_embedder

        embed = load_embedder(folder, threads)
        if (folder / S.VLM_FILE).is_file():
            vision = VisionParts.load(folder, threads)
    tok = TextTokenizer(folder) if (folder / S.TOKENIZER_FILE).is_file() else None
    if tok is not None and tok.eos_token and not eos:
        t = tok.token_id(tok.eos_token)
        eos = [t] if t is not None else []
    return Model(
        folder,
        variant,
        Decoder(sess, contract, embed, prefill),
        contract,
        tok,
        eos,
        manifest,
        vision=vision,
        path=Path(onnx_path),
    )


def _prefill_session(folder: Path, manifest: S.Manifest, variant: str, threads: int) -> Any:
    """The session of ``variant``'s prefill graph (layouts.rowwise: prompt chunks as multi-row
    attention over the decode graph's buffer), or None where the build wrote none or its gate
    failed (prompts then run on the decode graph: slower, said once)."""
    rec = manifest.variants[variant].prefill
    if not rec.get("file"):
        if manifest.variants[variant].kv_layout == S.KV_ROWWISE:
            logger.info(
                "%s: no prefill graph (%s); prompts run on the decode graph, slower: %s to add one",
                variant,
                rec.get("skipped") or "built before the build wrote one",
                rebuild_hint(manifest, folder.name),
            )
        return None
    if not rec.get("passed"):
        logger.info("%s: its prefill graph failed its gate at build; prompts run on the decode graph", variant)
        return None
    if rec.get("source_sha256") != manifest.variants[variant].sha256:
        raise IntegrityError(
            f"{folder.name}'s prefill graph of {variant} was made from another {variant} file than the one "
            f"it holds: {rebuild_hint(manifest, folder.name)}"
        )
    return make_session(member(folder, rec["file"]), threads)


def is_ours(folder: Path, name_or_path) -> bool:
    """Whether ``folder`` is (or was) one of our cache entries, which load only through their
    manifest: a cache name, a folder inside the cache, or one holding our contract.json. Anything
    else without a manifest is a third-party export, whose graph is its only contract."""
    if not is_path_like(name_or_path) or (folder / S.CONTRACT_FILE).is_file():
        return True
    try:
        return folder.resolve().is_relative_to(cache_root().resolve())
    except (OSError, RuntimeError):
        return True


def _eos_from_configs(folder: Path) -> list[int]:
    for name in (S.GENERATION_CONFIG_FILE, "config.json"):
        f = folder / name
        if f.is_file():
            e = json.loads(f.read_text()).get("eos_token_id")
            if e is not None:
                return [int(x) for x in (e if isinstance(e, list) else [e])]
    return []
