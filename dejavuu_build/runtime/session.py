"""The ORT session around one decoder graph, and the I/O contract derived from that graph.

Torch-free: onnxruntime and numpy only.
"""

from __future__ import annotations

import os
import re

from ..errors import ContractError
from ..schema import (
    ATTENTION_BIAS,
    HIDDEN_STATES,
    INPUT_IDS,
    INPUTS_EMBEDS,
    KV_CAPACITY_KEY,
    KV_CONCAT,
    KV_ROWWISE,
    KV_STATIC,
    KV_WRITE_INDEX,
    LOGITS,
    MASK_ADDITIVE_4D,
    MASK_NONE,
    MASK_PADDING_2D,
    POSITION_IDS,
    Contract,
    TensorSpec,
    row_guard_info,
)

_ORT_TYPES = {
    "tensor(float)": "float32",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(float16)": "float16",
    "tensor(bfloat16)": "bfloat16",
    "tensor(bool)": "bool",
}
_KV_PATTERNS = [  # (input regex, output pattern) for ours and common third-party exports
    (re.compile(r"^past_key_values\.(\d+)\.(key|value)$"), "present.{i}.{kv}"),
    (re.compile(r"^past_key_values_(\d+)_(key|value)$"), "present_{i}_{kv}"),
    (re.compile(r"^past\.(\d+)\.(key|value)$"), "present.{i}.{kv}"),
]


def _varint(f) -> int | None:
    out, shift = 0, 0
    while True:
        b = f.read(1)
        if not b:
            return None
        out |= (b[0] & 0x7F) << shift
        if b[0] < 0x80:
            return out
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than 64 bits")


def graph_domains(path: str | os.PathLike) -> set[str]:
    """The operator domains an ONNX file imports (ModelProto.opset_import), read off the file's
    top-level fields, the graph skipped by seeking: which of our own operators (kernels) a session
    of it needs, without onnx (not a runtime dependency) or reading the weights. Malformed
    files give what was read; onnxruntime then says what is wrong with them."""
    domains: set[str] = set()
    try:
        with open(path, "rb") as f:
            while (tag := _varint(f)) is not None:
                field_no, wire = tag >> 3, tag & 7
                if wire == 0:
                    _varint(f)
                elif wire in (1, 5):
                    f.seek(8 if wire == 1 else 4, os.SEEK_CUR)
                elif wire == 2:
                    n = _varint(f)
                    if n is None:
                        break
                    if field_no != 8:  # ModelProto.opset_import
                        f.seek(n, os.SEEK_CUR)
                        continue
                    body = f.read(n)
                    i = 0
                    while i < len(body):  # OperatorSetIdProto: domain = 1 (string), version = 2
                        t = body[i]
                        i += 1
                        if t == 0x0A:
                            ln = body[i]
                            i += 1
                            if ln >= 0x80:  # a domain name of 128+ bytes: not one of ours
                                break
                            domains.add(body[i : i + ln].decode("utf-8", "replace"))
                            i += ln
                        elif t == 0x10:
                            while i < len(body) and body[i] >= 0x80:
                                i += 1
                            i += 1
                        else:
                            break
                else:
                    break
    except (OSError, ValueError):
        pass
    return domains


def make_session(path: str | os.PathLike, threads: int | None = None, profile: str | None = None):
    """The session every runtime reader opens. ``profile``: onnxruntime's profiler on, its JSON
    named from this prefix (bench.anatomy reads per-node kernel times from it). A graph that runs
    one of our own operators (kernels.OPERATORS, by the domains it imports) gets its library,
    built from the package's source on this machine; nothing is ever loaded from the entry."""
    import onnxruntime as ort

    from ..kernels import register

    so = ort.SessionOptions()
    register(so, graph_domains(path))
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = str(profile)
    if threads:
        so.intra_op_num_threads = int(threads)
        so.inter_op_num_threads = 1
    so.log_severity_level = 3
    # Spinning threads make a decode step faster; full optimisation at load costs little more than
    # a cached optimised model, which would be one more machine-specific file to trust
    # (measured: docs/runtime.md).
    so.add_session_config_entry("session.intra_op.allow_spinning", "1")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001
        raise ContractError(
            f"onnxruntime cannot load {path}: {str(e).splitlines()[0][:300]}; the file may be corrupted: rebuild it"
        ) from None


def _spec(arg) -> TensorSpec:
    shape = [d if isinstance(d, int) else (str(d) if d is not None else "?") for d in (arg.shape or [])]
    return TensorSpec(arg.name, _ORT_TYPES.get(arg.type, arg.type), shape)


def derive_contract(session) -> Contract:
    """Read the contract off the graph's inputs and outputs (what a decoder really takes)."""
    ins = {a.name: _spec(a) for a in session.get_inputs()}
    outs = {a.name: _spec(a) for a in session.get_outputs()}
    if INPUT_IDS in ins:
        primary = INPUT_IDS
    elif INPUTS_EMBEDS in ins:
        primary = INPUTS_EMBEDS
    else:
        raise ContractError(f"decoder has neither {INPUT_IDS} nor {INPUTS_EMBEDS} among its inputs {list(ins)}")
    if LOGITS not in outs:
        raise ContractError(f"decoder has no `{LOGITS}` output (outputs: {list(outs)})")
    found: tuple[str, str, set[int]] | None = None  # (input pattern, output pattern, layers)
    for rx, out_pat in _KV_PATTERNS:
        m = [rx.match(n) for n in ins]
        hits = [x for x in m if x]
        if hits:
            in_pat = {
                r"^past_key_values\.(\d+)\.(key|value)$": "past_key_values.{i}.{kv}",
                r"^past_key_values_(\d+)_(key|value)$": "past_key_values_{i}_{kv}",
                r"^past\.(\d+)\.(key|value)$": "past.{i}.{kv}",
            }[rx.pattern]
            found = (in_pat, out_pat, {int(x.group(1)) for x in hits})
            break
    if found is None:
        raise ContractError("decoder has no past key/value inputs: a KV cache is required")
    in_pat, kv_out, layers = found
    num_layers = max(layers) + 1
    k0 = ins[in_pat.format(i=0, kv="key")]
    mask_input, mask_kind = None, MASK_NONE
    if ATTENTION_BIAS in ins and len(ins[ATTENTION_BIAS].shape) == 4:
        mask_input, mask_kind = ATTENTION_BIAS, MASK_ADDITIVE_4D
    elif "attention_mask" in ins:
        mask_input = "attention_mask"
        mask_kind = (
            MASK_ADDITIVE_4D
            if len(ins["attention_mask"].shape) == 4 and ins["attention_mask"].dtype.startswith("float")
            else MASK_PADDING_2D
        )
    logits = outs[LOGITS]
    hidden = outs.get(HIDDEN_STATES)
    # a static past length means the in-place flavour: past and present are one buffer; a write
    # index means the rowwise one (a grown buffer, its capacity recorded in the graph's metadata)
    layout, capacity = KV_CONCAT, 0
    meta = session.get_modelmeta().custom_metadata_map
    if isinstance(k0.shape[2], int) and k0.shape[2] > 0:
        layout, capacity = KV_STATIC, k0.shape[2]
    elif KV_WRITE_INDEX in ins:
        try:
            layout, capacity = KV_ROWWISE, int(meta.get(KV_CAPACITY_KEY, ""))
        except ValueError:
            raise ContractError(f"a rowwise decoder without its {KV_CAPACITY_KEY} metadata: rebuild it") from None
    return Contract(
        primary_input=primary,
        inputs=list(ins.values()),
        outputs=list(outs.values()),
        mask_input=mask_input,
        mask_kind=mask_kind,
        position_input=POSITION_IDS if POSITION_IDS in ins else None,
        hidden_output=HIDDEN_STATES if hidden is not None else None,
        kv_input_pattern=in_pat,
        kv_output_pattern=kv_out,
        num_layers=num_layers,
        num_kv_heads=k0.shape[1] if isinstance(k0.shape[1], int) else 0,
        head_dim=k0.shape[3] if isinstance(k0.shape[3], int) else 0,
        hidden_size=(
            hidden.shape[-1]
            if hidden is not None and isinstance(hidden.shape[-1], int)
            else ins[primary].shape[-1]
            if primary == INPUTS_EMBEDS
            else 0
        ),
        vocab_size=logits.shape[-1] if isinstance(logits.shape[-1], int) else 0,
        kv_dtype=k0.dtype,
        kv_layout=layout,
        kv_capacity=capacity,
        length_invariant=row_guard_info(meta).get("length_invariant") is True,
    )


def cross_check(derived: Contract, declared: Contract, where: str) -> None:
    """The graph must agree with contract.json on everything the graph can tell."""
    problems = []
    for f in (
        "primary_input",
        "mask_input",
        "mask_kind",
        "position_input",
        "hidden_output",
        "kv_input_pattern",
        "kv_output_pattern",
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "vocab_size",
        "kv_layout",
        "kv_capacity",
        "length_invariant",
    ):
        a, b = getattr(derived, f), getattr(declared, f)
        if a != b:
            problems.append(f"{f}: graph {a!r} vs contract {b!r}")
    if problems:
        raise ContractError(f"{where}: graph and contract.json disagree ({'; '.join(problems)}); rebuild it")
