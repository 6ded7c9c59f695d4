"""The image side of a SmolVLM / Idefics3 checkpoint as ONNX: the vision encoder + connector, and the
text model's token embedding (so the runtime can splice image features into ``inputs_embeds``).

``vision_encoder.onnx`` (dynamo exporter, opset 23)::

    inputs : pixel_values          float32 [num_images, 3, S, S]   (S = vision_config.image_size, static)
             pixel_attention_mask  bool    [num_images, S, S]      (True = real pixel, False = padding)
    outputs: image_features        float32 [num_real_images, image_seq_len, text_hidden]

It does what ``SmolVLMModel.get_image_features`` does for one sample's already-split tiles
(``pixel_values[None]``): images whose pixels are all exactly 0.0 are padding and are dropped (if all
are, image 0 is kept), the patch mask is "any real pixel in the patch", then the vision transformer
(patch conv + NaViT-style bucketed position ids, encoder with an additive key mask, post layernorm),
then the connector (pixel shuffle by ``scale_factor`` + linear projection).
``image_seq_len = (S // patch_size) ** 2 // scale_factor ** 2``.

Two rewrites make it exportable with a dynamic number of images, both exact:
 * the per-image Python loop of ``SmolVLMVisionEmbeddings.forward`` (position ids, ``bucketize``)
   is vectorised: the k-th unmasked patch of an image (row-major) gets the position id HF gives
   its k-th entry, with the same float32 arithmetic; ``bucketize(x, b, right=True)`` is
   ``sum(b <= x)``;
 * padding images are computed and then dropped at the end (a boolean gather) instead of before
   the encoder: every image is processed independently, so the kept rows are the same.

Position ids, two modes (``export_vision(..., position_ids=)``), two arithmetics:
 * ``"trained"``: ``bucketize(idx * (1 / nb))``, bit-identical to transformers <= 4.54
   (``arange(0, 1 - 1e-6, 1 / nb)``) and to 5.x (``idx * (1 / nb)``, clamped below 1), i.e. what
   SmolVLM / Idefics3 were trained with; for a full grid the ids are simply 0 .. nps^2 - 1.
 * ``"transformers"`` (the default of this function): whatever the installed transformers computes,
   found by running its own ``SmolVLMVisionEmbeddings.forward`` on every grid size
   (``installed_position_ids``): on 5.x the trained arithmetic; on 4.55 .. 4.57.x the "shrink"
   arithmetic ``bucketize(idx / nb * (1 - 1e-6))``, which in float32, on a full grid (nb == nps),
   puts patch row/column k >= 1 in bucket k - 1 (a full 32x32 grid uses ids up to 990, not 1023):
   huggingface/transformers#41190 (a regression since 4.55), fixed upstream by #41374.

Exporter: dynamo at opset 23 works (no fallback to the TorchScript exporter). One trap found on
the way: the onnxscript optimizer's no-op rules (``Mul(x, 1) -> x``, ``Add(x, 0) -> x``, ...) match
scalar constants with ``math.isclose(rel_tol=1e-5, abs_tol=1e-8)``, so ``x * (1 - 1e-6)`` silently
became ``x``; the factor is therefore a 1-element tensor here, and the export checks it survived.

``embed_tokens.onnx``::

    inputs : input_ids      int64   [batch, N]
    outputs: inputs_embeds  float32 [batch, N, text_hidden]

The Gather is named ``/model/embed_tokens/Gather`` and reads ``model.embed_tokens.weight`` — the
names the quantizer looks for — so the table can be 8-bit quantized later.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

from ..errors import ExportError
from ..log import logger
from ..schema import EMBED_NODE
from .exporter import OPSET, dynamo_export, save_model, scope_of

PIXEL_VALUES = "pixel_values"
PIXEL_ATTENTION_MASK = "pixel_attention_mask"
IMAGE_FEATURES = "image_features"
EMBED_INPUT = "input_ids"
EMBED_OUTPUT = "inputs_embeds"
EMBED_WEIGHT = "model.embed_tokens.weight"
_SHRINK = 1 - 1e-6  # SmolVLMVisionEmbeddings: fractional_coords = idx / nb_patches * (1 - 1e-6)


def vision_dims(config) -> dict[str, int]:
    """What the runtime needs to know about the vision side, from a SmolVLM/Idefics3 config."""
    vc = config.vision_config
    sf = int(config.scale_factor)
    return {
        "image_size": int(vc.image_size),
        "patch_size": int(vc.patch_size),
        "scale_factor": sf,
        "image_seq_len": int(((vc.image_size // vc.patch_size) ** 2) / (sf**2)),
        "image_token_id": int(config.image_token_id),
        "text_hidden_size": int(config.text_config.hidden_size),
        "vision_hidden_size": int(vc.hidden_size),
    }


POSITION_IDS_MODES = ("transformers", "trained")
ARITHMETICS = ("shrink", "trained")  # transformers 4.55-4.57 | <= 4.54, 5.x and the checkpoints


def _patch_position_ids(patch_mask, nps: int, boundaries, shrink, arithmetic: str, dtype):
    """Position ids of the unmasked patches ([B, ph*pw], 0 where masked): the vectorised
    ``SmolVLMVisionEmbeddings`` loop. The k-th unmasked patch (row-major) gets HF's
    ``pos_ids[k] = bucket_h[k // nb_w] * nps + bucket_w[k % nb_w]``."""
    import torch

    B, ph, pw = patch_mask.shape
    nb_h = patch_mask[:, :, 0].sum(dim=1)  # [B] int64
    nb_w = patch_mask[:, 0, :].sum(dim=1)
    flat = patch_mask.reshape(B, ph * pw)
    rank = flat.to(torch.int64).cumsum(dim=1) - 1
    nb_w_safe = torch.clamp(nb_w, min=1)[:, None]
    hi = torch.div(rank, nb_w_safe, rounding_mode="floor").to(dtype)
    wi = torch.remainder(rank, nb_w_safe).to(dtype)
    if arithmetic == "shrink":  # transformers 4.55-4.57: idx / nb * (1 - 1e-6)
        fh = hi / nb_h[:, None] * shrink
        fw = wi / nb_w[:, None] * shrink
    else:  # <= 4.54 / 5.x: arange(0, 1 - 1e-6, 1 / nb) == idx * (1 / nb)
        fh = hi * (1.0 / nb_h)[:, None]
        fw = wi * (1.0 / nb_w)[:, None]
    bh = (boundaries <= fh[..., None]).sum(dim=-1)  # bucketize(right=True)
    bw = (boundaries <= fw[..., None]).sum(dim=-1)
    return torch.where(flat, bh * nps + bw, torch.zeros_like(bh))


def installed_position_ids(vlm) -> str:
    """The arithmetic ("shrink" or "trained") the installed transformers' vision embeddings use,
    found by running their own forward on every rectangle of patches a grid can hold (k x k,
    k x nps, nps x k) with the convolution and the position table replaced by probes, so the ids
    come out directly. Where both arithmetics give the same ids at this grid size, "trained"."""
    from types import SimpleNamespace

    import torch

    emb = vlm.model.vision_model.embeddings
    nps, p = int(emb.num_patches_per_side), int(emb.patch_size)
    masks = []
    for k in range(1, nps + 1):
        for h, w in {(k, k), (k, nps), (nps, k)}:
            m = torch.zeros(nps, nps, dtype=torch.bool)
            m[:h, :w] = True
            masks.append(m)
    mask = torch.stack(masks)
    pv = torch.zeros(1, 1, 1, 1).expand(len(masks), 3, nps * p, nps * p)
    probe = SimpleNamespace(
        patch_size=p,
        num_patches_per_side=nps,
        image_size=nps * p,
        embed_dim=1,
        patch_embedding=lambda x: torch.zeros(x.shape[0], 1, nps, nps),
        position_embedding=lambda ids: ids[..., None].to(torch.float64),
    )
    try:
        with torch.no_grad():
            hf = type(emb).forward(probe, pv, mask)[..., 0].round().to(torch.int64)
    except Exception as e:  # noqa: BLE001 - any failure means we cannot tell: say so
        raise ExportError(
            f"vision export: cannot tell which patch position ids the installed transformers computes "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); pass --vision-position-ids trained"
        ) from None
    boundaries = torch.arange(1 / nps, 1.0, 1 / nps)
    shrink = torch.tensor([_SHRINK], dtype=torch.float32)
    ours = {a: _patch_position_ids(mask, nps, boundaries, shrink, a, torch.float32) for a in ARITHMETICS}
    if torch.equal(hf, ours["trained"]):
        return "trained"
    if torch.equal(hf, ours["shrink"]):
        return "shrink"
    raise ExportError(
        "vision export: the installed transformers computes patch position ids neither as the checkpoints "
        "were trained nor as transformers 4.55-4.57 do; pass --vision-position-ids trained"
    )


def _attention_bias(flat, dtype):
    """[B, T] bool (True = real patch) -> the additive [B, 1, T, T] key mask transformers 4.x's
    ``_prepare_4d_attention_mask`` builds (5.x has no such function), bit for bit."""
    import torch

    B, T = flat.shape
    expanded = flat[:, None, None, :].expand(B, 1, T, T).to(dtype)
    inverted = torch.tensor(1.0, dtype=dtype) - expanded
    return inverted.masked_fill(inverted.to(torch.bool), torch.finfo(dtype).min)


def _vision_wrapper(vlm, position_ids: str = "transformers"):
    import torch
    from torch import nn

    if position_ids not in POSITION_IDS_MODES:
        raise ExportError(f"position_ids must be one of {POSITION_IDS_MODES}, got {position_ids!r}")
    arithmetic = installed_position_ids(vlm) if position_ids == "transformers" else "trained"

    class VisionEncoder(nn.Module):
        def __init__(self, vlm):
            super().__init__()
            inner = vlm.model
            self.vision_model = inner.vision_model
            self.connector = inner.connector
            emb = self.vision_model.embeddings
            self.patch_size = emb.patch_size
            self.nps = emb.num_patches_per_side
            self.arithmetic = arithmetic
            # The same float32 constant HF builds on every call.
            self.register_buffer("boundaries", torch.arange(1 / self.nps, 1.0, 1 / self.nps), persistent=False)
            # HF multiplies by the Python float (1 - 1e-6); as a scalar constant the onnxscript optimizer's
            # "Mul(x, 1) -> x" rule (rel_tol 1e-5) deletes it, shifting every position id. A 1-element
            # tensor is not matched (scalars only) and gives bit-identical float32 products.
            self.register_buffer("shrink", torch.tensor([_SHRINK], dtype=torch.float32), persistent=False)

        def forward(self, pixel_values, pixel_attention_mask):
            p = self.patch_size
            B, _, H, W = pixel_values.shape
            ph, pw = H // p, W // p
            # Padding images are all 0.0; keep image 0 when every image is padding.
            real = (pixel_values != 0.0).flatten(1).any(dim=1)
            first = torch.arange(B, device=pixel_values.device) == 0
            real = real | (first & ~real.any())
            # unfold(size=p, step=p) twice + sum > 0 == any over each p x p block (remainder dropped).
            m = pixel_attention_mask[:, : ph * p, : pw * p].to(torch.bool)
            patch_mask = m.reshape(B, ph, p, pw, p).any(dim=4).any(dim=2)  # [B, ph, pw]

            emb = self.vision_model.embeddings
            x = emb.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # [B, ph*pw, D]
            flat = patch_mask.reshape(B, ph * pw)
            pos = _patch_position_ids(patch_mask, self.nps, self.boundaries, self.shrink, self.arithmetic, x.dtype)
            x = x + emb.position_embedding(pos)

            mask4 = _attention_bias(flat, x.dtype)
            x = self.vision_model.encoder(inputs_embeds=x, attention_mask=mask4).last_hidden_state
            x = self.vision_model.post_layernorm(x)
            feats = self.connector(x)
            return feats[real]

    return VisionEncoder(vlm)


def _finalize(proto, prefix: str = "") -> None:
    """Name nodes after their module (as the decoder exporter does) and drop exporter metadata."""
    used: collections.Counter[str] = collections.Counter()
    for nd in proto.graph.node:
        scope = [s for s in scope_of(nd)[:-1] if s]
        module = scope[-1] if scope else ""
        base = "/" + "/".join(module.split(".")).replace("/layers/", "/layers.") if module else ""
        name = f"{prefix}{base}/{nd.op_type}"
        used[name] += 1
        nd.name = name if used[name] == 1 else f"{name}_{used[name] - 1}"
        del nd.metadata_props[:]
    del proto.metadata_props[:]


def _check_shrink_kept(proto) -> None:
    """Fail loudly if the (1 - 1e-6) factor of the position-id buckets was optimized away."""
    import numpy as np
    from onnx import numpy_helper

    target = np.float32(_SHRINK)
    inits = {i.name: i for i in proto.graph.initializer}
    for nd in proto.graph.node:
        if nd.op_type != "Mul":
            continue
        for x in nd.input:
            if x in inits:
                a = numpy_helper.to_array(inits[x])
                if a.size == 1 and a.dtype == np.float32 and a.reshape(()) == target:
                    return
    raise ExportError(
        "vision export: the (1 - 1e-6) position-bucket factor was optimized out of the graph "
        "(onnxscript no-op rule); position ids would be wrong"
    )


def _summary(proto, seconds: float) -> dict[str, Any]:
    ops = collections.Counter(nd.op_type for nd in proto.graph.node)
    return {"seconds": seconds, "nodes": len(proto.graph.node), "opset": OPSET, "op_counts": dict(ops.most_common())}


def export_vision(vlm_model, out_path: Path, *, position_ids: str = "transformers") -> dict[str, Any]:
    """Export ``vlm_model``'s vision encoder + connector to ``out_path`` (see the module docstring).

    ``position_ids`` picks the patch position-id arithmetic (see the module docstring):
    ``"transformers"`` matches the installed transformers bit for bit (4.55-4.57: "shrink"; 5.x:
    "trained"); ``"trained"`` is what the checkpoints were trained with (transformers <= 4.54 and
    after the fix of huggingface/transformers#41190).

    Returns ``{"seconds", "nodes", "opset", "op_counts", "inputs", "outputs", "position_ids",
    "position_ids_arithmetic", **vision_dims(config)}``."""
    import torch

    dims = vision_dims(vlm_model.config)
    S = dims["image_size"]
    wrapper = _vision_wrapper(vlm_model, position_ids).eval()
    arithmetic = wrapper.arithmetic
    n = 3  # > 1 so torch.export keeps the image count symbolic
    g = torch.Generator().manual_seed(0)
    pv = torch.randn(n, 3, S, S, generator=g)
    mask = torch.ones(n, S, S, dtype=torch.bool)
    Nd = torch.export.Dim("num_images", min=1, max=4096)
    dynamic = ({0: Nd}, {0: Nd})
    proto, seconds = dynamo_export(
        wrapper, (pv, mask), out_path, [PIXEL_VALUES, PIXEL_ATTENTION_MASK], [IMAGE_FEATURES], dynamic, "vision encoder"
    )
    if arithmetic == "shrink":
        _check_shrink_kept(proto)
    _finalize(proto, prefix="")
    out = proto.graph.output[0].type.tensor_type.shape.dim
    if len(out) == 3:
        out[0].ClearField("dim_value")
        out[0].dim_param = "num_real_images"
    info = _summary(proto, seconds)  # before save_model adds fp16_store's Cast nodes
    save_model(proto, Path(out_path))
    logger.info("  vision encoder: %d nodes in %.1fs", info["nodes"], seconds)
    info.update(
        {
            "inputs": {PIXEL_VALUES: ["num_images", 3, S, S], PIXEL_ATTENTION_MASK: ["num_images", S, S]},
            "outputs": {IMAGE_FEATURES: ["num_real_images", dims["image_seq_len"], dims["text_hidden_size"]]},
            "position_ids": position_ids,
            "position_ids_arithmetic": arithmetic,
        }
    )
    info.update(dims)
    return info


def export_embeddings(vlm_model, out_path: Path) -> dict[str, Any]:
    """Export the text model's token embedding: ``input_ids [batch, N] -> inputs_embeds [batch, N, H]``.

    Uses the model's own input-embedding module, so scaled embeddings (Gemma-style) stay exact."""
    import torch
    from torch import nn

    class Embed(nn.Module):
        def __init__(self, emb):
            super().__init__()
            self.embed_tokens = emb

        def forward(self, input_ids):
            return self.embed_tokens(input_ids)

    emb = vlm_model.get_input_embeddings()
    wrapper = Embed(emb).eval()
    ids = torch.randint(0, min(int(emb.num_embeddings), 100), (2, 3))
    dynamic = ({0: torch.export.Dim("batch", min=1, max=1024), 1: torch.export.Dim("N", min=1, max=131072)},)
    proto, seconds = dynamo_export(wrapper, (ids,), out_path, [EMBED_INPUT], [EMBED_OUTPUT], dynamic, "token embedding")
    _finalize(proto, prefix="/model")
    g = proto.graph
    inits = {i.name: i for i in g.initializer}
    gathers = [nd for nd in g.node if nd.op_type == "Gather" and nd.input[0] in inits]
    if len(gathers) != 1:
        raise ExportError(f"token embedding export: expected one Gather on a table, found {len(gathers)}")
    gather = gathers[0]
    gather.name = EMBED_NODE
    old = gather.input[0]
    if old != EMBED_WEIGHT:
        inits[old].name = EMBED_WEIGHT
        for nd in g.node:
            for i, x in enumerate(nd.input):
                if x == old:
                    nd.input[i] = EMBED_WEIGHT
    info = _summary(proto, seconds)
    save_model(proto, Path(out_path))
    info.update(
        {
            "inputs": {EMBED_INPUT: ["batch", "N"]},
            "outputs": {EMBED_OUTPUT: ["batch", "N", int(emb.embedding_dim)]},
            "vocab_size": int(emb.num_embeddings),
            "hidden_size": int(emb.embedding_dim),
        }
    )
    logger.info("  token embedding: %d nodes in %.1fs", info["nodes"], seconds)
    return info
