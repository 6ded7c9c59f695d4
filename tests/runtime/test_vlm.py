"""The SmolVLM path on a tiny random SmolVLM: ORT runtime greedy generation with an image equals
torch `generate` token for token, in chain and tree mode with several drafters; bad input errors."""

import numpy as np
import pytest
from PIL import Image

from dejavuu_build.build.config import TreeDecoderConfig
from dejavuu_build.build.pipeline import build_tree_decoder
from dejavuu_build.errors import GenerationError
from dejavuu_build.runtime import load
from dejavuu_build.schema import read_manifest


@pytest.fixture(scope="module")
def vlm_build(cache_dir):
    from tiny import save_tiny

    src = save_tiny("smolvlm", cache_dir.parent / "src-tiny-vlm")
    cfg = TreeDecoderConfig(
        model=str(src),
        name="tiny-vlm",
        primary_input="inputs_embeds",
        vision=True,
        vision_position_ids="transformers",
        timing=False,
        reference_tokens=12,
    )
    return src, build_tree_decoder(cfg).folder


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("img")
    rng = np.random.default_rng(0)
    paths = []
    for i, (w, h) in enumerate([(50, 40), (30, 70)]):
        p = d / f"im{i}.png"
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(p)
        paths.append(p)
    return paths


def test_vlm_build_records_everything(vlm_build):
    _, folder = vlm_build
    m = read_manifest(folder)
    assert m.kind == "vlm" and m.variants["fp32"].passed
    for f in ("vision_encoder.onnx", "embed_tokens.onnx", "vlm.json", "preprocessor_config.json"):
        assert f in m.files
    assert m.export["vision"]["nodes"] > 0
    # the serving batch graph on inputs_embeds: written and gated like a text build's
    assert m.batched["passed"] and m.batched["file"] in m.files and m.batched["gate"]["mismatches"] == 0


@pytest.mark.parametrize("n_images", [1, 2])
def test_generation_equals_torch_generate(vlm_build, images, n_images):
    import torch
    from transformers import SmolVLMForConditionalGeneration

    src, folder = vlm_build
    model = load(folder, variant="fp32")
    imgs = images[:n_images]
    prompt = "Describe this image."
    base = model.generate(prompt, images=imgs, max_new_tokens=24)
    ids, _ = model.vision.prefill(prompt, imgs, model.tokenizer, model.decoder.embed)
    pv, mask, _, _ = model.vision.pre(imgs)
    hf = SmolVLMForConditionalGeneration.from_pretrained(src).eval()
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            pixel_values=torch.tensor(pv)[None],
            pixel_attention_mask=torch.tensor(mask)[None],
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    torch_tokens = out[0, len(ids) :].tolist()
    assert base.tokens == torch_tokens
    for method in ("pld", "suffix_decoding", "token_recycling", "lookahead"):
        for tree in (False, True):
            r = model.generate(prompt, images=imgs, method=method, tree=tree, max_new_tokens=24)
            assert r.tokens == torch_tokens, (method, tree)


def test_vlm_bad_input(vlm_build, images, tmp_path, tiny_llama):
    _, folder = vlm_build
    model = load(folder)
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not an image")
    with pytest.raises(GenerationError, match="broken.png"):
        model.generate("Describe.", images=[bad])
    with pytest.raises(GenerationError, match="takes no images"):
        load(tiny_llama).generate("Describe.", images=images[:1])
    with pytest.raises(GenerationError, match="positions"):
        model.generate("Describe.", images=images * 40, max_new_tokens=8)
    with pytest.raises(GenerationError, match="placeholders"):
        model.generate("<image> and <image>", images=images[:1])


def test_the_server_takes_openai_image_parts(vlm_build, images, tmp_path):
    """`dejavuu-build serve` on a VLM build, through the openai client: a chat message with an
    `image_url` part (a data: URL) answers what `generate` gives for the same image and text."""
    import base64

    openai = pytest.importorskip("openai")
    from dejavuu_build.serve.bench import start_server

    _, folder = vlm_build
    model = load(folder, variant="fp32")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}]
    ref = model.generate(msgs, images=images[:1], method="pld", max_new_tokens=16)
    url = "data:image/png;base64," + base64.b64encode(images[0].read_bytes()).decode()
    proc, base = start_server(
        folder.name, "--variant", "fp32", "--method", "pld", log_path=str(tmp_path / "server.log")
    )
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        r = client.chat.completions.create(
            model=folder.name,
            max_tokens=16,
            temperature=0,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "Describe this image."},
                    ],
                }
            ],
        )
        assert r.choices[0].message.content == ref.text and r.usage.completion_tokens == len(ref.tokens)
        with pytest.raises(openai.BadRequestError, match="data: URLs"):
            client.chat.completions.create(
                model=folder.name,
                max_tokens=4,
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
            )
    finally:
        proc.terminate()
        proc.wait(30)
