"""The build's export step: load the model, export the fp32 decoder, compute the torch references,
export the embedding and the vision graph (a VLM: what the recipe says of its image tokens and
processor), save the tokenizer and write the declared contract; returns the new entry's manifest."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

from .. import schema as S
from ..errors import ValidationFailed
from ..log import step
from ..schema import REFERENCE_FILE, TOKENIZER_FILES, Contract, Manifest, variant_file, write_json
from .config import TreeDecoderConfig


def export_fp32(
    cfg: TreeDecoderConfig, src, tmp: Path, name: str, key: str, tools: dict, *, references: bool = True
) -> Manifest:
    """Everything of the entry that comes from torch, into ``tmp``; the manifest to fill in.
    ``references=False`` (bench.synthetic's speed-only build of a random-weight model, which has no
    gates to feed) leaves out the torch references. The torch model is freed before the fp32 graph
    is opened for its contract: the two side by side were two fp32 copies of the model at once
    (measured: docs/sizes.md, Memory)."""
    from ..export.exporter import export_decoder, text_dims
    from .references import compute_reference
    from .sources import load_model_and_tokenizer

    with step(f"load {src.id}"):
        model, tok, gen, recipe = load_model_and_tokenizer(src, hidden_layer=cfg.hidden_layer)
    with step(f"export fp32 ({recipe.name} recipe, dynamo, opset 23)") as t_exp:
        info = export_decoder(
            model, recipe, tmp / variant_file(S.FP32), hidden_layer=cfg.hidden_layer, primary=cfg.primary_input
        )
    if references:
        with step("torch fp32 references (greedy continuations, chain and tree parity)"):
            ref = compute_reference(
                model,
                recipe,
                tok,
                hidden_layer=cfg.hidden_layer,
                new_tokens=cfg.reference_tokens,
                primary=cfg.primary_input,
            )
            ref.save(tmp / REFERENCE_FILE)
            del ref
    lm = recipe.text_causal_lm(model)
    extra: dict = {}
    if cfg.primary_input == S.INPUTS_EMBEDS:
        from ..export.vision import export_embeddings

        with step("export token embedding"):
            extra["embeddings"] = export_embeddings(lm, tmp / S.EMBED_FILE)
    if cfg.vision:
        extra["vision"] = _export_vision(cfg, src, recipe, model, tmp)
    _save_tokenizer(tok, gen, tmp)
    config = model.config
    dims = text_dims(recipe, config)
    del model, lm  # the last references to the torch weights: freed before the fp32 graph is opened
    contract = _declared_contract(tmp, cfg, recipe, config, gen, dims)
    write_json(tmp / S.CONTRACT_FILE, contract.to_json())
    return Manifest(
        name=name,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        cache_key=key,
        build_config=cfg.to_json(),
        source=src.to_json(),
        recipe=recipe.name,
        tools=tools,
        export={
            "seconds": round(t_exp.seconds, 1),
            "torch_export_seconds": round(info.seconds, 1),
            "nodes": info.nodes,
            "opset": info.opset,
            "op_counts": info.op_counts,
            "tied_embeddings": info.tied_embeddings,
            "hidden_layer": cfg.hidden_layer,
            **extra,
        },
        kind=S.KIND_VLM if cfg.vision else S.KIND_DECODER,
    )


def _export_vision(cfg, src, recipe, model, tmp: Path) -> dict:
    """Vision encoder + connector graph, processor settings and the image-token facts the runtime
    needs (the recipe's: Recipe.image_tokens, Recipe.default_processor_config)."""
    from ..export.vision import export_vision, vision_dims

    recipe_vlm = hasattr(model.config, "vision_config")
    if not recipe_vlm:
        raise ValidationFailed(f"{src.id} has no vision tower: use `dejavuu-build tree-decoder` for text models")
    with step("export vision encoder + connector"):
        info = export_vision(model, tmp / S.VISION_FILE, position_ids=cfg.vision_position_ids)
    dims = vision_dims(model.config)
    pre = _processor_config(src, recipe, dims)
    write_json(tmp / S.PREPROCESSOR_FILE, pre)
    if int(pre.get("max_image_size", {}).get("longest_edge", dims["image_size"])) != dims["image_size"]:
        raise ValidationFailed("processor max_image_size differs from the vision tower's image_size")
    write_json(
        tmp / S.VLM_FILE,
        {
            **dims,
            **recipe.image_tokens(),
            "position_ids": cfg.vision_position_ids,
        },
    )
    return info


def _processor_config(src, recipe, dims: dict) -> dict:
    """The checkpoint's preprocessor_config.json, or the recipe's defaults sized to this vision tower."""
    folder = Path(src.path) if Path(src.path).is_dir() else Path(src.path).parent
    f = folder / S.PREPROCESSOR_FILE
    if f.is_file():
        return json.loads(f.read_text())
    return recipe.default_processor_config(dims)


def _declared_contract(folder: Path, cfg, recipe, config, gen, dims) -> Contract:
    from ..runtime.session import derive_contract, make_session

    c = derive_contract(make_session(folder / variant_file(S.FP32), threads=1))
    c.hidden_layer = cfg.hidden_layer
    c.num_heads = dims["num_heads"]
    c.max_positions = dims["max_positions"]
    c.sliding_window = recipe.sliding_windows(config)
    c.eos_token_ids = recipe.eos_token_ids(config, gen)
    tc = recipe.text_config(config)
    c.bos_token_id = getattr(tc, "bos_token_id", None)
    c.pad_token_id = getattr(tc, "pad_token_id", None)
    if c.hidden_size == 0:
        c.hidden_size = dims["hidden_size"]
    return c


def _save_tokenizer(tok, gen, folder: Path) -> None:
    if tok is None:
        return
    tmpdir = folder / ".tok"
    tok.save_pretrained(tmpdir)
    if gen is not None:
        gen.save_pretrained(tmpdir)
    for f in TOKENIZER_FILES:
        if (tmpdir / f).is_file():
            (tmpdir / f).rename(folder / f)
    if not (folder / S.TOKENIZER_FILE).is_file():
        raise ValidationFailed(f"the tokenizer could not be saved as {S.TOKENIZER_FILE} (a fast tokenizer is required)")
    if not (folder / S.CHAT_TEMPLATE_FILE).is_file() and getattr(tok, "chat_template", None):
        (folder / S.CHAT_TEMPLATE_FILE).write_text(tok.chat_template)
    import shutil

    shutil.rmtree(tmpdir, ignore_errors=True)
