"""A decoder past protobuf's 2 GB limit: weights in external data, end to end (export, record,
verify, load, generate) with nothing left behind and nothing unrecorded."""

import numpy as np
import pytest

from dejavuu_build import schema as S


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A one-layer Llama whose untied 1.1M-token vocabulary makes 2.25 GB of fp32 weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dejavuu_build.export.exporter import export_decoder
    from dejavuu_build.recipes import registered

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1_100_000,
        hidden_size=256,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        eos_token_id=2,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
        for n, b in model.named_buffers():
            if n.endswith("inv_freq"):
                theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]  # 4.x | 5.x
                b.copy_(1.0 / (theta ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)))
    model.eval()
    folder = tmp_path_factory.mktemp("big")
    export_decoder(model, registered()["llama"](), folder / S.variant_file("fp32"))
    ids = [5, 17, 900_000, 42]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    del model
    return folder, ids, ref


def test_export_writes_one_data_file_and_nothing_else(big):
    folder, _, _ = big
    files = sorted(p.name for p in folder.iterdir())
    assert files == [S.variant_file("fp32"), S.variant_file("fp32") + ".data"]
    assert (folder / (S.variant_file("fp32") + ".data")).stat().st_size > 2_000_000_000
    assert (folder / S.variant_file("fp32")).stat().st_size < 10_000_000


def test_record_verify_load_and_generate(big):
    """The manifest covers the data file (a flipped byte is caught), and the runtime loads and
    runs the model with torch's logits."""
    from dejavuu_build.cache import record_files, verify_entry
    from dejavuu_build.errors import CacheError
    from dejavuu_build.runtime import load
    from dejavuu_build.runtime.session import derive_contract, make_session

    folder, ids, ref = big
    contract = derive_contract(make_session(folder / S.variant_file("fp32"), threads=2))
    contract.max_positions, contract.eos_token_ids = 256, [2]
    S.write_json(folder / S.CONTRACT_FILE, contract.to_json())
    f = folder / S.variant_file("fp32")
    m = S.Manifest(
        name="big",
        variants={"fp32": S.VariantRecord(file=f.name, bytes=f.stat().st_size, sha256=S.sha256_file(f), passed=True)},
        default_variant="fp32",
    )
    record_files(folder, m)
    S.write_json(folder / S.MANIFEST_FILE, m.to_json())
    assert f.name + ".data" in m.files
    verify_entry(folder)
    model = load(folder)
    logits, _, _ = model.decoder.forward(ids, None, model.decoder.new_cache())
    np.testing.assert_allclose(logits, ref, atol=1e-4)
    data = folder / (f.name + ".data")
    with open(data, "r+b") as fh:  # a flipped byte in the external data is drift
        fh.seek(1_000_000)
        b = fh.read(1)
        fh.seek(1_000_000)
        fh.write(bytes([b[0] ^ 1]))
    with pytest.raises(CacheError):
        verify_entry(folder)


def test_quantize_and_static_flavour_past_2gb(big, tmp_path):
    """The quantizer and the static-KV pass read external data and write it where needed."""
    import onnx

    from dejavuu_build.export.exporter import save_model
    from dejavuu_build.export.passes.static_kv import to_static_kv
    from dejavuu_build.quantize import PLANS, quantize_model
    from dejavuu_build.runtime.decoder import Decoder
    from dejavuu_build.runtime.session import derive_contract, make_session

    folder, ids, ref = big
    src = folder / S.variant_file("fp32")
    static = tmp_path / S.variant_file("fp32-static")
    save_model(to_static_kv(onnx.load(str(src)), 64), static)
    assert (tmp_path / (static.name + ".data")).stat().st_size > 2_000_000_000
    sess = make_session(static, threads=2)
    dec = Decoder(sess, derive_contract(sess))
    logits, _, _ = dec.forward(ids, None, dec.new_cache())
    np.testing.assert_allclose(logits, ref, atol=1e-4)
    q = tmp_path / S.variant_file("int8")
    quantize_model(src, q, PLANS["int8"], tied=False)
    assert q.stat().st_size < 2_000_000_000 and not (tmp_path / (q.name + ".data")).exists()
    sess = make_session(q, threads=2)
    dec = Decoder(sess, derive_contract(sess))
    lq, _, _ = dec.forward(ids, None, dec.new_cache())
    assert np.corrcoef(lq.ravel(), ref.ravel())[0, 1] > 0.99
