"""The precisions, one table: each one's name, quantization plan, gate floors and place in the default.

``PRECISIONS`` is the one place a precision is known. The quantizer reads its plan
(quantize.nbits.quantize_model), the gates and the quality gate its floors (build.gates,
build.quality), the auto build and the default picker its tier and default floors
(build.pipeline), the CLIs its name (build.cli, build.config), the schema its name and order
(schema.VARIANTS, schema.variant_order), the bench the onnxruntime-genai builder's name for it.
Adding a precision is one entry here (docs/extending.md, "A precision").

Pure Python (no numpy, no onnx): the schema, and through it the runtime, read the names and order.
Readers look the table up when they run, so an entry added at run time (``register``) is seen by all.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, replace

FP32, INT8, INT4, INT4OP = "fp32", "int8", "int4", "int4op"

# What a variant must keep of the model to be the default, whatever its size or speed (its quality
# gate against fp32): one under these passes its own gate and can be asked for, but is not the default.
DEFAULT_TOP1 = 0.95
DEFAULT_MEAN_KL = 0.02


@dataclass(frozen=True)
class QuantPlan:
    body_bits: int = 4
    body_block: int = 32
    lm_head_bits: int = 8
    lm_head_block: int = 128
    embed_bits: int = 8
    accuracy_level: int = 4  # int8 activations inside MatMulNBits: faster on CPU
    symmetric: bool = False  # re-quantized blocks: False = a zero point per block (asymmetric)
    gguf_min: str = "offset"  # GGUF blocks with a minimum (Q4_1, Q4_K, ...): "offset" (exact, fast
    # kernels + an fp32 block-sum term), "nearest" integer zero point
    # (fast, not exact), "float_zp" (exact, slow kernels) or "q41" (exact: the file's
    # 4-bit blocks in our own operator, kernels.q41; other sources rounded to that form)
    # The 8-bit lm-head (tied: the embedding table too): the GGUF's own table blocks (Q8_0: blocks
    # of 32, carried bit for bit) wherever they keep rows as exact as the best block does on this
    # machine (carry_table, the default: the file's answers, a choice that follows bit comparisons
    # only, so quant-only rewrites the same bytes). Else the largest block from lm_head_block down to
    # 16 whose MatMulNBits keeps rows exact (choose_table_block). The cost, measured: SmolLM2's Q8_0
    # lm-head in blocks of 32 ran 1.08-1.15x the time of re-rounded blocks of 64 (about 2% of a step).
    carry_table: bool = True
    # With gguf_min "q41": the lm-head (tied: a copy of the table in the operator's layout) and the
    # body's other 8-bit blocks of 32 in our operator too (kernels.q41's centred form), rows exact
    # by construction (no block to measure); its 8-row step is what a verify step pays most for
    lm_head_op: bool = False
    # With carry_table off: carry the file's blocks only where they run at most this factor slower,
    # at 1, 2 and 8 rows, than the largest exact block (timed at build: the bytes follow the load).
    table_carry_slowdown: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Precision:
    """One precision. ``plan`` None: the fp32 export itself, the reference every other precision is
    quantized from and scored against (it gets the parity gate; it is the default only where no
    quantized variant keeps the model's answers)."""

    name: str
    plan: QuantPlan | None
    # gates.gate_teacher_forced: top-1 agreement with torch's greedy continuations of the 4 gate
    # prompts (96 positions on a real build), a coarse check that the variant runs the model at all
    teacher_forced_floor: float
    # quality.gate_quality: top-1 agreement with the fp32 export over the quality set (32 texts x 64
    # tokens): what a variant must keep to pass its gate at all (docs/quantization.md has the figures)
    quality_floor: float
    # the auto build (pipeline._auto_variants): tier 1 is built; each next tier only when no variant
    # of the tiers before it passes its gates and keeps the model's answers. None: only on request
    # (--variants), or the reference (always exported)
    auto_tier: int | None = None
    # may be the default only where its quality gate meets these (pipeline.keeps_answers)
    default_top1: float = DEFAULT_TOP1
    default_mean_kl: float = DEFAULT_MEAN_KL
    # onnxruntime-genai's builder's name for a like precision (`-p`): what the bench's peer is built at
    genai: str | None = None
    # our own operators its graphs run (kernels: their onnxruntime domains), compiled on the machine
    # that runs them: a graph with one loads only in our runtime, never in onnxruntime-genai or the
    # `dejavuu` package, and is built only where the operator compiles and loads
    operators: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name.isalnum() or self.name != self.name.lower():
            raise ValueError(f"a precision's name is lower-case letters and digits (got {self.name!r})")

    @property
    def reference(self) -> bool:
        return self.plan is None


# The order is the variants' order everywhere (schema.variant_order): the reference first.
# int8: 8-bit blocks lose so little that a zero point buys nothing measurable; its 8-bit table in
# blocks of 32 carries a Q8_0 embedding exactly. Its body stays in blocks of 32 although wider ones
# stream fewer scales: MLAS rounds the activations to int8 per weight block too, and blocks of 64
# (chosen by choose_body_block, the down projection kept at 32) cost SmolLM2-135M's gate top-1
# 0.975 -> 0.961 and KL 0.0039 -> 0.0053 for a one-token step 0.94-0.96x (docs/speed.md). int4: for a GGUF source, the file's own blocks
# carried exactly (gguf_min="offset": the model as published, not a second rounding of it); what
# the file does not hold (other sources, GGUF types it cannot carry) is re-rounded with a zero
# point per block (asymmetric: closer to the weights than symmetric on both real models measured)
# where this machine's 4-bit kernel keeps rows exact with zero points (zero_points_row_exact),
# else symmetric. The 8-bit lm-head table (tied: the embedding's too) takes the largest block from
# lm_head_block (128) down that keeps rows exact on the building machine, or the GGUF's own table
# where it keeps them exact too and is as fast (choose_table_block; blocks of 128 are row-variant on
# an Intel AMX Xeon at K = 640). (Figures: docs/quantization.md, docs/exactness.md.)
# The auto build makes int4 (in every KV layout), then int4op and int8 only when no int4 keeps the
# answers (else each as a timed trial, build.trial).
_INT4_PLAN = QuantPlan(
    body_bits=4, body_block=32, lm_head_bits=8, lm_head_block=128, embed_bits=8, symmetric=False, gguf_min="offset"
)
PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision(FP32, None, teacher_forced_floor=0.98, quality_floor=0.99, genai="fp32"),
        Precision(
            INT8,
            QuantPlan(body_bits=8, body_block=32, lm_head_bits=8, lm_head_block=32, embed_bits=8, symmetric=True),
            teacher_forced_floor=0.85,
            quality_floor=0.96,
            auto_tier=3,
            genai="int8",
        ),
        Precision(INT4, _INT4_PLAN, teacher_forced_floor=0.70, quality_floor=0.75, auto_tier=1, genai="int4"),
        # int4op: int4's plan with the GGUF's blocks of 32 as the file holds them (levels, d, and
        # the minimum m where the type has one; float16 where the file's are) in our exact
        # operator (kernels.q41) instead of MatMulNBits plus the offset term, the lm-head too. One
        # node per projection and no second rounding: one-token steps 0.64x int4-static's on the
        # AMD EPYC with AVX-512 VNNI, with a better gate (docs/speed.md, twenty-third session).
        # A timed trial of the auto build (build.trial), kept only where clearly faster; tried before
        # int8 (faster than it on the CPU measured, so int8's trial then skips its gates).
        Precision(
            INT4OP,
            replace(_INT4_PLAN, gguf_min="q41", lm_head_op=True),
            teacher_forced_floor=0.70,
            quality_floor=0.75,
            auto_tier=2,
            genai="int4",
            operators=("dejavuu.q41", "dejavuu.attn"),
        ),
    )
}


def register(p: Precision) -> Precision:
    """Add ``p`` to the table (after the others in the variants' order); a name is registered once."""
    if p.name in PRECISIONS:
        raise ValueError(f"precision {p.name!r} is already registered")
    if p.reference:
        raise ValueError(f"{p.name}: only {FP32} is the reference; a new precision needs a quantization plan")
    PRECISIONS[p.name] = p
    return p


def names() -> tuple[str, ...]:
    """Every precision, in the variants' order (the reference first)."""
    return tuple(PRECISIONS)


def quantized() -> tuple[str, ...]:
    """The precisions made from the fp32 export by a plan (what quant-only redoes)."""
    return tuple(n for n, p in PRECISIONS.items() if not p.reference)


def plan(name: str) -> QuantPlan:
    p = PRECISIONS[name].plan
    if p is None:
        raise ValueError(f"{name} is the reference export: it has no quantization plan")
    return p


def auto_tiers() -> list[tuple[str, ...]]:
    """The auto build's precisions, tier by tier (pipeline._auto_variants)."""
    tiers = sorted({p.auto_tier for p in PRECISIONS.values() if p.auto_tier is not None})
    return [tuple(n for n, p in PRECISIONS.items() if p.auto_tier == t) for t in tiers]


def quality_floors() -> dict[str, float]:
    """precision -> its quality gate's floor (quality.gate_quality)."""
    return {n: p.quality_floor for n, p in PRECISIONS.items()}


class _PlanView(Mapping[str, QuantPlan]):
    """name -> plan of every quantized precision: a view of PRECISIONS, not a second table."""

    def __getitem__(self, name: str) -> QuantPlan:
        p = PRECISIONS[name]
        if p.plan is None:
            raise KeyError(name)
        return p.plan

    def __iter__(self) -> Iterator[str]:
        return iter(quantized())

    def __len__(self) -> int:
        return len(quantized())


PLANS: Mapping[str, QuantPlan] = _PlanView()
