"""manifest.json's `provenance` view (schema.manifest_provenance): the keys the `dejavuu` package
(0.2.0) resolves files through, derived on every write, and old manifests still read."""

import json

from dejavuu_build import schema as S


def _text_manifest(**kw) -> S.Manifest:
    variants = {
        v: S.VariantRecord(file=S.variant_file(v), sha256=f"sha-{v}", kv_layout=S.split_variant(v)[1])
        for v in ("int4", "fp32", "int8", "int4-static", "int8-rowwise")
    }
    return S.Manifest(
        name="m",
        kind="decoder",
        variants=variants,
        build_config={"primary_input": "input_ids"},
        files={r.file: {"sha256": r.sha256, "bytes": 1} for r in variants.values()},
        **kw,
    )


def test_text_view_lists_the_concat_variants_by_file():
    d = _text_manifest().to_json()
    assert d["schema_version"] == S.MANIFEST_SCHEMA_VERSION == 2
    p = d["provenance"]
    assert p["model_kind"] == "text_onnx"
    assert list(p["variants"]) == ["fp32", "int8", "int4"]  # in-place layouts need inputs a plain loop lacks
    for v, rec in p["variants"].items():
        assert rec["file"] == f"decoder_{v}.onnx" and rec["file"] in d["files"] and rec["sha256"] == f"sha-{v}"
    assert "graphs" not in p and "image_token_id" not in p
    json.dumps(d)


def test_vlm_view_names_every_graph_per_variant():
    m = S.Manifest(
        name="v",
        kind="vlm",
        build_config={"primary_input": "inputs_embeds", "vision": True},
        variants={
            v: S.VariantRecord(file=S.variant_file(v), kv_layout=S.split_variant(v)[1])
            for v in ("fp32", "int8", "int4", "int4-static")
        },
        export={"embeddings": {"nodes": 3}, "vision": {"nodes": 9, "image_token_id": 250}},
    )
    p = m.to_json()["provenance"]
    assert p["model_kind"] == "smolvlm_onnx" and p["image_token_id"] == 250
    assert "variants" not in p  # the decoder takes inputs_embeds: the package's text class cannot feed it
    assert p["graphs"] == {
        "decoder": {v: f"decoder_{v}.onnx" for v in ("fp32", "int8", "int4")},
        "embed_tokens": {v: "embed_tokens.onnx" for v in ("fp32", "int8", "int4")},
        "vision_encoder": {v: "vision_encoder.onnx" for v in ("fp32", "int8", "int4")},
    }


def test_the_view_is_derived_never_read_back():
    m = _text_manifest()
    d = m.to_json()
    d["provenance"]["variants"]["fp32"]["file"] = "elsewhere.onnx"  # a stale or edited view
    again = S.Manifest.from_json(d)
    assert again == m and again.to_json() == m.to_json()


def test_a_version_1_manifest_reads_and_is_rewritten_with_the_view():
    old = _text_manifest().to_json()
    old.pop("provenance")
    old["schema_version"] = 1
    m = S.Manifest.from_json(old)
    assert m.schema_version == 1 and m.variants["int8"].file == "decoder_int8.onnx"
    new = m.to_json()
    assert new["schema_version"] == 2 and list(new["provenance"]["variants"]) == ["fp32", "int8", "int4"]


def test_a_datastore_manifest_has_no_view():
    d = S.Manifest(name="ds", kind="datastore").to_json()
    assert "provenance" not in d
