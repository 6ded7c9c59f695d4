"""The one manifest / contract schema. The build writes it, the runtime reads it: both import this.

It also owns every name the two sides share, so that none is spelled twice: a cache entry's files
and the cache's folders (cache-layout.md), I/O and node names, KV layouts, graph metadata keys and
the defaults the CLIs show. Pure Python (no torch, no onnx) so the runtime can use it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .precisions import FP32 as FP32  # the precisions' names, re-exported (S.FP32 ...)
from .precisions import INT4 as INT4
from .precisions import INT8 as INT8
from .precisions import PRECISIONS

SCHEMA_VERSION = 1

# The files of a cache entry (cache-layout.md): the build writes them, the runtime and `verify` read them.
CONTRACT_FILE = "contract.json"
MANIFEST_FILE = "manifest.json"
DECODER_FILE = "decoder_{variant}.onnx"  # one per variant (variant_file)
# the serving batch graph of one static variant (batched_file; Manifest.batched records it)
BATCHED_FILE = "decoder_{variant}.batched.onnx"
# a rowwise variant's prefill graph (prefill_file; VariantRecord.prefill records it)
PREFILL_FILE = "decoder_{variant}.prefill.onnx"
REFERENCE_FILE = "reference.npz"  # torch's references, so quant-only validates without torch
EMBED_FILE = "embed_tokens.onnx"  # inputs_embeds builds: input_ids -> inputs_embeds
VISION_FILE = "vision_encoder.onnx"  # VLM builds: pixel_values -> image_features
VLM_FILE = "vlm.json"  # VLM builds: image token id, image sequence length, tiles
PREPROCESSOR_FILE = "preprocessor_config.json"  # VLM builds: what the numpy image preprocessor reads
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
# copied beside the decoder so that the runtime needs neither transformers nor the hub
TOKENIZER_FILES = (
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    "special_tokens_map.json",
    CHAT_TEMPLATE_FILE,
    GENERATION_CONFIG_FILE,
)
DATASTORE_TOKENS_FILE = "tokens.npy"  # a datastore entry: its token ids, -1 between documents
DATASTORE_SUFFIXES_FILE = "suffixes.npy"  # ... their suffix array
DATASTORE_FILE = "datastore.json"  # ... counts and format version

# Folders under the cache root, beside the entries (cache-layout.md).
STAGING_DIR = ".staging"  # builds in progress, swapped in when complete
LOCKS_DIR = ".locks"  # one flock per entry name
SOURCES_DIR = ".sources"  # `pypi:<dist>` model sources (build.sources)
SOURCE_FILE = "source.json"  # ... each one's dist, version and sha256
RUNTIME_DIR = ".runtime"  # machine-local exactness calibrations (runtime.calibration)
KERNELS_DIR = ".kernels"  # our own operators, compiled on this machine (kernels/): one folder per key
PEERS_DIR = ".peers"  # `bench --compare genai`: onnxruntime-genai's own builds (bench.genai)
PEER_FILE = "peer.json"  # ... each one's builder versions and sha256s
BENCH_DIR = "bench"  # `dejavuu-build bench` outputs

# I/O names, fixed in one place.
INPUT_IDS = "input_ids"
INPUTS_EMBEDS = "inputs_embeds"
POSITION_IDS = "position_ids"
ATTENTION_BIAS = "attention_bias"
SLOT_ROWS = "slot_rows"  # static flavour: the row each attention slot reads (export.passes.static_kv)
ROW_SLOTS = "row_slots"  # ... and the slot of each row
KV_WRITE_INDEX = "kv_write_index"  # rowwise flavour: the first buffer position a step writes (its past)
LOGITS = "logits"
# [1] int64, an input of the in-place flavours: logits come out for the rows from it on (0: all). A
# prefill needs its last row's only (export.passes.common.slice_logits); the concat export, what
# other runtimes load, has no such input.
LOGITS_FROM = "logits_from"
HIDDEN_STATES = "hidden_states"
PAST_KEY = "past_key_values.{i}.key"
PAST_VALUE = "past_key_values.{i}.value"
PRESENT_KEY = "present.{i}.key"
PRESENT_VALUE = "present.{i}.value"

# Precisions: their names, plans, floors and order are one table (precisions.PRECISIONS), read
# here too. VARIANTS is a view of its names as imported; code that must see a precision registered
# later (precisions.register) reads the table (precisions.names()).
VARIANTS = tuple(PRECISIONS)
# KV layouts: how a variant's graph holds its cache (Contract.kv_layout, VariantRecord.kv_layout).
KV_CONCAT = "concat"  # present = past + new: the exported graph, what other runtimes load
KV_STATIC = "static"  # in place: GroupQueryAttention over one bound buffer (export.passes.static_kv)
GQA_MIN_ROWS = 2  # GroupQueryAttention's rows agree bit for bit among any row counts >= 2, not with 1
KV_ROWWISE = "rowwise"  # in place, every query row on one-row kernels (export.passes.rowwise_kv)
KV_LAYOUTS = (KV_CONCAT, KV_STATIC, KV_ROWWISE)  # what the build does with each: layouts.LAYOUTS (its registry)
STATIC_SUFFIX = "-static"  # "int4-static": int4 with the in-place KV cache
ROWWISE_SUFFIX = "-rowwise"  # "int4-rowwise": in place, one-row attention
LAYOUT_SUFFIXES = {KV_STATIC: STATIC_SUFFIX, KV_ROWWISE: ROWWISE_SUFFIX}  # a concat variant has none
# Node names the exporter gives and the quantizer looks up (export.exporter.finalize_graph).
LM_HEAD_NODE = "/lm_head/MatMul"
EMBED_NODE = "/model/embed_tokens/Gather"

# The serving batch graph's inputs beside the static graph's (export.passes.serve_batch writes
# them, serve.batch feeds them).
SEQLENS_K = "seqlens_k"  # [B] int32: tokens in each entry's cache after this step, minus one
QUERY_SEQLENS = "query_seqlens"  # [B] int32: valid (unpadded) rows of each entry this step
PAD_INDEX = "pad_index"  # [B, S] int64: packed row of each padded row (pads: any valid row)
UNPAD_INDEX = "unpad_index"  # [1, T] int64: padded row (b * S + s) of each packed row
GQA_POSITIONS = "padded_position_ids"  # [B, S] int64: positions in the padded layout
# The serving batch pass's version, recorded with its graph (Manifest.batched): bump it when the
# pass changes what the server feeds; a server refuses a graph of another version.
BATCHED_GRAPH_VERSION = 3

# Entry kinds (Manifest.kind).
KIND_DECODER = "decoder"
KIND_VLM = "vlm"  # a decoder on inputs_embeds, with a vision encoder
KIND_DATASTORE = "datastore"
ENTRY_KINDS = (KIND_DECODER, KIND_VLM, KIND_DATASTORE)
DECODER_KINDS = (KIND_DECODER, KIND_VLM)  # the kinds that hold decoder variants

# Mask kinds (Contract.mask_kind): what a graph's mask input is.
MASK_ADDITIVE_4D = "additive_4d"  # [1, 1, rows, past + rows] float bias: chains and trees
MASK_PADDING_2D = "padding_2d"  # a 2D padding mask (third-party exports): chains only
MASK_NONE = "none"

# Graph metadata keys (written by the export passes, read by the runtime).
KV_LAYOUT_KEY = "dejavuu.kv_layout"
KV_CAPACITY_KEY = "dejavuu.kv_capacity"
PREFILL_KEY = "dejavuu.prefill"  # JSON: the prefill graph's source variant (export.passes.rowwise_prefill)
ROW_GUARD_KEY = "dejavuu.row_guard"  # JSON: length_invariant, guarded ops, the machine they were measured on

# Defaults shared by the build, the runtime, the bench and the server (their CLIs show them).
DEFAULT_THREADS = 2  # onnxruntime intra-op threads (the runtime: unless DEJAVUU_THREADS says otherwise)
DEFAULT_MAX_CONTEXT = 8192  # in-place KV capacity without --max-context: the model's limit, at most this
DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_TREE_WIDTH = 2  # children per draft node in tree mode
DEFAULT_MAX_DEPTH = 8  # longest draft path per step
# Prompt rows per prefill forward (runtime.job.Job.prefill_rows; serve.batch.measure_exact). The
# boundaries are the same however a request is driven (generate, the API, the server), so every
# path prefills alike. Why 128: with the lm-head on the chunk's last row only, a chunk's cost is its
# products' and its attention's; SmolLM2-135M `int8`, AMD EPYC (avx512_vnni, no AMX), 2 threads,
# 5 interleaved rounds, 256 / 1024 prompt tokens, ms per chunk size 64 / 128 / 256 / 512: static
# 338 / 290 / 293 / 307 and 1295 / 1219 / 1217 / 1257; rowwise with its prefill graph 339 / 295 /
# 295 / 315 and 1406 / 1209 / 1227 / 1291; rowwise alone 368 / 330 / 335 / 342 and 1633 / 1488 /
# 1533 / 1662 (docs/speed.md). A static prompt's bits do not depend on the chunk size (its
# GroupQueryAttention rows agree among any row counts >= 2: measured equal for 32 to 256). 64
# before (measured on the AMX Xeon while every row still paid the lm-head).
PREFILL_CHUNK = 128
# `dejavuu-build serve` (serve.cli, serve.scheduler, serve.memory)
DEFAULT_MAX_BATCH = 8  # requests decoded together
DEFAULT_MAX_QUEUE = 32  # requests waiting beyond those; more get HTTP 429
DEFAULT_MEMORY_TOKENS = 2_000_000  # cross-request drafter memory, tokens per namespace


def batched_inputs(contract: "Contract") -> set[str]:
    """What the server feeds the serving batch graph of a variant with this contract (serve.batch),
    by KV layout: a graph that takes none of one of these is not that variant's batch graph."""
    own = {contract.primary_input} | {n for n in (contract.mask_input, contract.position_input) if n}
    if contract.kv_layout == KV_STATIC:  # the ragged GroupQueryAttention graph (export.passes.serve_batch)
        return (own - {contract.position_input}) | {GQA_POSITIONS, SEQLENS_K, QUERY_SEQLENS, PAD_INDEX, UNPAD_INDEX}
    if contract.kv_layout == KV_ROWWISE:
        return own | {KV_WRITE_INDEX}
    return set()


def batched_file(variant: str) -> str:
    return BATCHED_FILE.format(variant=variant)


def prefill_file(variant: str) -> str:
    return PREFILL_FILE.format(variant=variant)


def variant_file(variant: str) -> str:
    return DECODER_FILE.format(variant=variant)


def variant_name(precision: str, kv_layout: str = KV_CONCAT) -> str:
    return precision + LAYOUT_SUFFIXES.get(kv_layout, "")


def split_variant(variant: str) -> tuple[str, str]:
    """(precision, kv layout) of a variant name: ``int4`` -> (int4, concat), ``int4-static`` -> (int4, static)."""
    for layout, suffix in LAYOUT_SUFFIXES.items():
        if variant.endswith(suffix):
            return variant[: -len(suffix)], layout
    return variant, KV_CONCAT


def in_place(kv_layout: str) -> bool:
    """Layouts whose past and present are one buffer bound through I/O binding."""
    return kv_layout in LAYOUT_SUFFIXES


def variant_order(variant: str) -> tuple[int, int]:
    """Sort key of a variant: its precision's place in the table (an unknown one last), then its layout."""
    prec, layout = split_variant(variant)
    order = list(PRECISIONS)
    return (order.index(prec) if prec in order else len(order), KV_LAYOUTS.index(layout))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "int64", "float32"
    shape: list[Any]  # ints for static dims, strings for dynamic ones


@dataclass
class Contract:
    """What a decoder graph takes and gives; derived from the graph and cross-checked at load."""

    schema_version: int = SCHEMA_VERSION
    primary_input: str = INPUT_IDS  # input_ids | inputs_embeds
    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[TensorSpec] = field(default_factory=list)
    mask_input: str | None = ATTENTION_BIAS
    mask_kind: str = MASK_ADDITIVE_4D  # additive_4d (tree-capable) | padding_2d | none
    position_input: str | None = POSITION_IDS
    hidden_output: str | None = HIDDEN_STATES
    hidden_layer: int = -1
    kv_input_pattern: str = "past_key_values.{i}.{kv}"
    kv_output_pattern: str = "present.{i}.{kv}"
    num_layers: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    hidden_size: int = 0
    vocab_size: int = 0
    max_positions: int = 0
    sliding_window: list[int | None] = field(default_factory=list)  # per layer; None = full attention
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    kv_dtype: str = "float32"
    # concat: present = past + new | static: in-place buffer, GroupQueryAttention | rowwise: in-place
    # buffer grown in tiles, each query row attended on its own (export.passes.rowwise_kv)
    kv_layout: str = KV_CONCAT
    kv_capacity: int = 0  # static / rowwise: positions the buffer holds (at most)
    # a row gets the same bits whatever the forward's row count, as measured where the graph was
    # built (export.exactness + passes.row_guard): a lone token runs as one row, unpadded
    length_invariant: bool = False

    @property
    def tree_capable(self) -> bool:
        return self.mask_kind == MASK_ADDITIVE_4D and self.position_input is not None

    @property
    def position_limit(self) -> int:
        """Positions a context may hold: the in-place buffer's capacity, else the model's limit."""
        return self.kv_capacity if in_place(self.kv_layout) else (self.max_positions or 1 << 30)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Contract":
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        d["inputs"] = [TensorSpec(**t) for t in d.get("inputs", [])]
        d["outputs"] = [TensorSpec(**t) for t in d.get("outputs", [])]
        return cls(**d)


@dataclass
class VariantRecord:
    file: str
    bytes: int = 0
    sha256: str = ""
    quant: dict = field(default_factory=dict)  # the quantization plan applied
    gates: dict = field(default_factory=dict)  # gate name -> figures and pass/fail
    passed: bool = False
    timings_ms: dict = field(default_factory=dict)  # "n1_p256" -> ms
    verify_cost_ratio: float | None = None  # N8 / N1 at past 256
    kv_layout: str = KV_CONCAT  # see Contract.kv_layout
    kv_capacity: int = 0
    timing_rounds_ms: list = field(default_factory=list)  # per interleaved round: mean forward ms
    length_invariant: bool = False  # see Contract.length_invariant
    row_guard: dict = field(default_factory=dict)  # per-op row invariance measured at build, what was guarded
    calibration: dict = field(default_factory=dict)  # runtime.calibration measured at build: key, record
    # a rowwise variant's prefill graph (build.prefill_graph): file, sha256, source_sha256, gate, passed
    prefill: dict = field(default_factory=dict)


def variant_contract(contract: "Contract", record: "VariantRecord | None") -> "Contract":
    """contract.json describes the unguarded concat flavour; a variant differs in its KV layout and
    in whether the build made it length-invariant."""
    import dataclasses

    if record is None or (
        record.kv_layout == contract.kv_layout and record.length_invariant == contract.length_invariant
    ):
        return contract
    return dataclasses.replace(
        contract, kv_layout=record.kv_layout, kv_capacity=record.kv_capacity, length_invariant=record.length_invariant
    )


def row_guard_info(metadata: dict[str, str]) -> dict:
    """A graph's row-guard record (ROW_GUARD_KEY) from its metadata map; {} when it has none."""
    try:
        d = json.loads(metadata.get(ROW_GUARD_KEY, "{}"))
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {}


# 2: manifest.json also carries the `provenance` view (manifest_provenance); nothing else changed,
# and readers of 1 (no view) keep working: the view is derived, never read back. The optional
# `batched` record came later within 2: readers that do not know it ignore it (from_json).
MANIFEST_SCHEMA_VERSION = 2


@dataclass
class Manifest:
    schema_version: int = MANIFEST_SCHEMA_VERSION
    name: str = ""
    kind: str = KIND_DECODER  # ENTRY_KINDS
    created: str = ""
    cache_key: str = ""
    build_config: dict = field(default_factory=dict)
    source: dict = field(default_factory=dict)  # kind, id, revision, sha256, path
    recipe: str = ""
    tools: dict = field(default_factory=dict)
    export: dict = field(default_factory=dict)  # seconds, nodes, opset, op counts
    quantize: dict = field(default_factory=dict)  # seconds
    variants: dict[str, VariantRecord] = field(default_factory=dict)
    default_variant: str | None = None
    default_reason: dict = field(default_factory=dict)  # the rule, the noise, the margin, the candidates
    files: dict[str, dict] = field(default_factory=dict)  # relpath -> {sha256, bytes}
    steps: list = field(default_factory=list)  # [step, seconds] of the last build or quant-only, in order
    # The serving batch graph of the static variant `serve` loads (the default precision's): variant,
    # file, bytes, sha256, source_sha256 (its static graph's), graph_version, passed, gate (figures
    # and machine). {} for entries built before it was part of the build, and for datastores.
    batched: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        view = manifest_provenance(self)
        if view:  # what is written is this version's format, whatever version was read
            d["schema_version"] = max(self.schema_version, MANIFEST_SCHEMA_VERSION)
            d["provenance"] = view
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Manifest":
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        d["variants"] = {k: VariantRecord(**v) for k, v in d.get("variants", {}).items()}
        return cls(**d)


def portable(variant: str) -> bool:
    """Whether other runtimes (onnxruntime-genai, the `dejavuu` package) can load ``variant``: it
    runs none of our own operators (precisions.Precision.operators, compiled by our runtime)."""
    p = PRECISIONS.get(split_variant(variant)[0])
    return p is None or not p.operators


def manifest_provenance(m: "Manifest") -> dict:
    """The view of a decoder build that the `dejavuu` package (0.2.0) resolves its files through.

    ``DejaVu.from_pretrained(<entry>, variant=V)`` opens ``provenance.variants[V].file`` (text,
    ``dejavuu.decoders.text``); its VLM class opens ``provenance.graphs[role][V]`` for the roles
    decoder / embed_tokens / vision_encoder and takes ``provenance.image_token_id``; its bench reads
    ``model_kind`` and warns on ``variants[V].speculative_compatible`` false. Only concat variants are
    listed: an in-place one (static, rowwise) takes inputs a plain loop does not feed (slot_rows,
    row_slots / kv_write_index, a bound fixed-capacity buffer), nor one that runs our own operators
    (``portable``). A decoder on inputs_embeds appears
    under ``graphs`` only. Derived from the rest of the manifest on every write, never read back:
    the manifest's own fields keep their meaning. {} for a datastore.
    """
    if m.kind not in DECODER_KINDS:
        return {}
    concat = sorted(
        (v for v, r in m.variants.items() if r.kv_layout == KV_CONCAT and portable(v)),
        key=variant_order,
    )
    view: dict = {"format": "dejavuu-provenance/1", "model_kind": "smolvlm_onnx" if m.kind == KIND_VLM else "text_onnx"}
    if m.build_config.get("primary_input", INPUT_IDS) == INPUT_IDS:
        view["variants"] = {
            v: {
                "file": m.variants[v].file,
                "sha256": m.variants[v].sha256,
                "precision": split_variant(v)[0],
                "speculative_compatible": bool(getattr(m.variants[v], "length_invariant", False)),
            }
            for v in concat
        }
    embed = EMBED_FILE if "embeddings" in m.export or EMBED_FILE in m.files else None
    vision = VISION_FILE if "vision" in m.export or VISION_FILE in m.files else None
    if embed:
        view["graphs"] = {
            "decoder": {v: m.variants[v].file for v in concat},
            "embed_tokens": {v: embed for v in concat},
        }
        if vision:
            view["graphs"]["vision_encoder"] = {v: vision for v in concat}
    if isinstance(m.export.get("vision"), dict) and "image_token_id" in m.export["vision"]:
        view["image_token_id"] = int(m.export["vision"]["image_token_id"])
    return view


def write_json(path: str | os.PathLike, obj: dict) -> None:
    """Write JSON via a temporary file and rename, so readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


def read_manifest(folder: str | os.PathLike) -> Manifest:
    return Manifest.from_json(json.loads((Path(folder) / MANIFEST_FILE).read_text()))


def read_contract(folder: str | os.PathLike) -> Contract:
    return Contract.from_json(json.loads((Path(folder) / CONTRACT_FILE).read_text()))
