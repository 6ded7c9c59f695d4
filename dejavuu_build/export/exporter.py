"""torch -> ONNX with the dynamo exporter (opset 23: fused Attention, RotaryEmbedding, RMSNormalization),
then deterministic naming so later passes pick the lm-head and embeddings by name."""

from __future__ import annotations

import ast
import collections
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import schema as S
from ..errors import ExportError
from ..log import logger
from ..schema import EMBED_NODE, LM_HEAD_NODE

OPSET = 23


@dataclass
class ExportInfo:
    seconds: float
    nodes: int
    opset: int
    op_counts: dict[str, int] = field(default_factory=dict)
    tied_embeddings: bool = False


def text_dims(recipe, config) -> dict[str, Any]:
    tc = recipe.text_config(config)
    heads = tc.num_attention_heads
    return {
        "num_layers": tc.num_hidden_layers,
        "num_heads": heads,
        "num_kv_heads": getattr(tc, "num_key_value_heads", None) or heads,
        "head_dim": getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        "hidden_size": tc.hidden_size,
        "vocab_size": tc.vocab_size,
        "max_positions": int(getattr(tc, "max_position_embeddings", 0) or 0),
    }


def export_decoder(
    model: Any, recipe, out_path: Path, *, hidden_layer: int = -1, primary: str = S.INPUT_IDS
) -> ExportInfo:
    """Export ``model`` (a full HF model of ``recipe``'s family) as a tree-capable decoder."""
    import torch

    from .wrapper import DecoderWrapper

    dims = text_dims(recipe, model.config)
    L, kv, D, H = dims["num_layers"], dims["num_kv_heads"], dims["head_dim"], dims["hidden_size"]
    lm = recipe.text_causal_lm(model).eval()
    wrapper = DecoderWrapper(
        lm, L, recipe.sliding_windows(model.config), recipe.mask_argument, hidden_layer=hidden_layer, primary=primary
    ).eval()
    n, p = 3, 5  # sample sizes: > 1 so torch.export keeps them symbolic
    if primary == S.INPUTS_EMBEDS:
        first = torch.randn(1, n, H)
    else:
        first = torch.randint(0, min(dims["vocab_size"], 100), (1, n))
    pos = torch.arange(p, p + n)[None]
    bias = torch.zeros(1, 1, n, p + n)
    past = [torch.zeros(1, kv, p, D) for _ in range(2 * L)]
    Nd = torch.export.Dim("N", min=1, max=8192)
    Pd = torch.export.Dim("P", min=0, max=131071)  # 131072 fails a guard, costing a second trace
    Td = torch.export.Dim("T", min=1, max=131072)
    first_dims = {1: Nd}
    dynamic = (first_dims, {1: Nd}, {2: Nd, 3: Td}, tuple({2: Pd} for _ in past))
    in_names = [primary, S.POSITION_IDS, S.ATTENTION_BIAS] + [
        S.PAST_KEY.format(i=i) if k == 0 else S.PAST_VALUE.format(i=i) for i in range(L) for k in (0, 1)
    ]
    out_names = [S.LOGITS, S.HIDDEN_STATES] + [
        S.PRESENT_KEY.format(i=i) if k == 0 else S.PRESENT_VALUE.format(i=i) for i in range(L) for k in (0, 1)
    ]
    proto, seconds = dynamo_export(
        wrapper, (first, pos, bias, *past), out_path, in_names, out_names, dynamic, f"decoder (recipe {recipe.name})"
    )
    tied = finalize_graph(proto)
    ops = collections.Counter(nd.op_type for nd in proto.graph.node)
    nodes = len(proto.graph.node)  # before save_model adds fp16_store's Cast nodes
    save_model(proto, out_path)
    logger.info("  exported %d nodes (%s)", nodes, ", ".join(f"{k}×{v}" for k, v in ops.most_common(6)))
    return ExportInfo(
        seconds=seconds,
        nodes=nodes,
        opset=OPSET,
        op_counts=dict(ops.most_common()),
        tied_embeddings=tied,
    )


def dynamo_export(module, args, out_path: Path, in_names, out_names, dynamic, what: str):
    """torch.onnx dynamo export at OPSET into a scratch file; returns (ModelProto, export seconds).
    The one place every graph of ours (decoder, vision encoder, embedding) is exported."""
    import onnx
    import torch

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".raw")
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module,
                args,
                str(tmp),
                dynamo=True,
                opset_version=OPSET,
                input_names=in_names,
                output_names=out_names,
                dynamic_shapes=dynamic,
                external_data=False,
                verbose=False,
            )
    except Exception as e:
        raise ExportError(
            f"torch.onnx export of the {what} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    seconds = time.perf_counter() - t0
    proto = onnx.load(str(tmp))  # external data (a model past 2 GB) is read in here
    for leftover in tmp.parent.glob(tmp.name + "*"):  # the graph and the exporter's .data files
        leftover.unlink()
    return proto, seconds


EXTERNAL_DATA_BYTES = 1_800_000_000  # protobuf cannot serialise a message of 2 GB or more


def tensor_bytes(proto) -> int:
    """Bytes of the graph's initializers, without serialising it (ByteSize() itself fails past 2 GB)."""
    import numpy as np

    total = 0
    for t in proto.graph.initializer:
        total += len(t.raw_data) if t.raw_data else int(np.prod(t.dims, dtype=np.int64)) * 4
    return total


def save_model(proto, path: Path) -> None:
    """Save one file, or a file plus ``<name>.data`` when over the 2 GB protobuf limit. A stale
    ``<name>.data`` of an earlier save is removed, so the folder holds exactly what is loaded.
    fp16-exact fp32 weights are stored as fp16 (fp16_store.pack, in ``proto`` too): read a saved
    graph back with fp16_store.load_unpacked to rewrite it."""
    import onnx

    from .fp16_store import pack

    pack(proto)
    path = Path(path)
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)
    if tensor_bytes(proto) > EXTERNAL_DATA_BYTES:
        onnx.save(
            proto,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=path.name + ".data",
            size_threshold=1024,
        )
    else:
        onnx.save(proto, str(path))


def scope_of(node) -> list[str]:
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            try:
                return ast.literal_eval(p.value)
            except (ValueError, SyntaxError):
                return []
    return []


def finalize_graph(proto) -> bool:
    """Name nodes after their module (``/model/layers.0/self_attn/q_proj/MatMul``), name linear
    weights after their module, drop exporter metadata (paths, stack traces) so builds are
    reproducible. Returns whether the lm-head shares its weight with the embedding (tied)."""
    g = proto.graph
    used: collections.Counter[str] = collections.Counter()
    inits = {i.name: i for i in g.initializer}
    renamed_inits: dict[str, str] = {}
    producers = {o: nd for nd in g.node for o in nd.output}
    for nd in g.node:
        scope = [s for s in scope_of(nd)[:-1] if s]  # last entry is the fx node itself
        module = scope[-1] if scope else ""
        if module.startswith("lm."):
            module = module[3:]
        elif module == "lm":
            module = ""
        base = "/" + "/".join(module.split(".")).replace("/layers/", "/layers.") if module else ""
        # "model.layers.0.self_attn" -> "/model/layers.0/self_attn"
        name = f"{base}/{nd.op_type}"
        used[name] += 1
        nd.name = name if used[name] == 1 else f"{name}_{used[name] - 1}"
        if (
            nd.op_type == "MatMul"
            and module
            and len(nd.input) == 2
            and nd.input[1] in inits
            and nd.input[1] not in renamed_inits
            and not nd.input[1].startswith(("model.", "lm"))
        ):
            renamed_inits[nd.input[1]] = f"{module}.weight_T"
        del nd.metadata_props[:]
    # The lm-head: the MatMul producing logits.
    lm_node = producers.get(S.LOGITS)
    if lm_node is None or lm_node.op_type != "MatMul":
        raise ExportError("could not find the lm-head MatMul producing `logits`")
    lm_node.name = LM_HEAD_NODE
    embed = next(
        (nd for nd in g.node if nd.op_type == "Gather" and len(nd.input) == 2 and nd.input[1] in (S.INPUT_IDS,)), None
    )
    if embed is not None:
        embed.name = EMBED_NODE
    w = lm_node.input[1]
    tied = False
    if w not in inits and w in producers and producers[w].op_type == "Transpose":
        src = producers[w].input[0]
        tied = embed is not None and embed.input[0] == src
    for init in g.initializer:  # "lm.model.norm.weight" -> "model.norm.weight"
        if init.name.startswith("lm.") and init.name not in renamed_inits:
            renamed_inits[init.name] = init.name[3:]
    if renamed_inits:
        for init in g.initializer:
            if init.name in renamed_inits:
                init.name = renamed_inits[init.name]
        for nd in g.node:
            for i, x in enumerate(nd.input):
                if x in renamed_inits:
                    nd.input[i] = renamed_inits[x]
    del proto.metadata_props[:]
    dedupe_unary(g)
    return tied


DEDUPED_OPS = ("Cos", "Sin")


def dedupe_unary(g) -> int:
    """Drop repeats of an elementwise op on the same input (DEDUPED_OPS), rewiring their readers to
    the first: the exporter writes RoPE's cos/sin once per q and k of every layer (4 per layer, 120 on
    SmolLM2) from the same positions. onnxruntime's CSE removes them at load, but the file, the
    per-op tables and every tool that is not onnxruntime should not carry them. Returns how many."""
    first: dict[tuple[str, str], str] = {}
    alias: dict[str, str] = {}
    keep = []
    outputs = {o.name for o in g.output}
    for nd in g.node:
        for i, x in enumerate(nd.input):
            if x in alias:
                nd.input[i] = alias[x]
        if nd.op_type in DEDUPED_OPS and len(nd.input) == 1 and len(nd.output) == 1 and not nd.attribute:
            key = (nd.op_type, nd.input[0])
            if key in first and nd.output[0] not in outputs:
                alias[nd.output[0]] = first[key]
                continue
            first.setdefault(key, nd.output[0])
        keep.append(nd)
    if alias:
        del g.node[:]
        g.node.extend(keep)
    return len(alias)
