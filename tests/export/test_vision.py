"""SmolVLM vision encoder + connector and token-embedding graphs: ORT vs torch parity."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from dejavuu_build.export.vision import export_embeddings, export_vision, installed_position_ids, vision_dims
from dejavuu_build.recipes.smolvlm import SmolVLMRecipe
from dejavuu_build.schema import EMBED_NODE


@pytest.fixture(scope="module")
def tiny_vlm():
    return SmolVLMRecipe().tiny_model(seed=0)


@pytest.fixture(scope="module")
def graphs(tiny_vlm, tmp_path_factory):
    d = tmp_path_factory.mktemp("vision")
    infos = {
        "transformers": export_vision(tiny_vlm, d / "vision_transformers.onnx"),
        "trained": export_vision(tiny_vlm, d / "vision_trained.onnx", position_ids="trained"),
        "embed": export_embeddings(tiny_vlm, d / "embed_tokens.onnx"),
    }
    paths = {
        "transformers": d / "vision_transformers.onnx",
        "trained": d / "vision_trained.onnx",
        "embed": d / "embed_tokens.onnx",
    }
    return paths, infos


def _session(path):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _batch(seed=1):
    """5 tiles: full, all-zero padding, partly masked (3x2 of 4x4 patches), full, one patch row."""
    g = torch.Generator().manual_seed(seed)
    pv = torch.randn(5, 3, 32, 32, generator=g)
    mask = torch.ones(5, 32, 32, dtype=torch.bool)
    pv[1] = 0
    mask[1] = False
    mask[2, 20:, :] = False  # rows 0..19 -> patch rows 0..2 (row 16..19 makes patch row 2 real)
    mask[2, :, 12:] = False  # cols 0..11 -> patch cols 0..1
    pv[2][:, ~mask[2]] = 0
    mask[4, 8:, :] = False
    pv[4][:, ~mask[4]] = 0
    return pv, mask


def _old_embeddings_forward(self, pixel_values, patch_attention_mask):
    """SmolVLMVisionEmbeddings.forward as in transformers <= 4.54 (what the checkpoints were trained with)."""
    batch_size, _, max_im_h, max_im_w = pixel_values.shape
    embeddings = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
    max_h, max_w = max_im_h // self.patch_size, max_im_w // self.patch_size
    boundaries = torch.arange(1 / self.num_patches_per_side, 1.0, 1 / self.num_patches_per_side)
    position_ids = torch.full(size=(batch_size, max_h * max_w), fill_value=0)
    for batch_idx, p_attn_mask in enumerate(patch_attention_mask):
        nb_patches_h = p_attn_mask[:, 0].sum()
        nb_patches_w = p_attn_mask[0].sum()
        fractional_coords_h = torch.arange(0, 1 - 1e-6, 1 / nb_patches_h)
        fractional_coords_w = torch.arange(0, 1 - 1e-6, 1 / nb_patches_w)
        bucket_coords_h = torch.bucketize(fractional_coords_h, boundaries, right=True)
        bucket_coords_w = torch.bucketize(fractional_coords_w, boundaries, right=True)
        pos_ids = (bucket_coords_h[:, None] * self.num_patches_per_side + bucket_coords_w).flatten()
        position_ids[batch_idx][p_attn_mask.view(-1)] = pos_ids
    return embeddings + self.position_embedding(position_ids)


def _image_features(vlm, pv, mask) -> np.ndarray:
    """``get_image_features`` of one sample as [images, image_seq_len, hidden]: a tensor on
    transformers 4.x; on 5.x a ModelOutput whose ``pooler_output`` holds each sample's features
    flattened to [images * image_seq_len, hidden]."""
    out = vlm.model.get_image_features(pv[None], mask[None])
    if not isinstance(out, torch.Tensor):
        flat = torch.cat(list(out.pooler_output))
        out = flat.reshape(-1, vlm.model.image_seq_len, flat.shape[-1])
    return out.numpy()


def _torch_features(vlm, pv, mask, mode):
    with torch.no_grad():
        if mode == "transformers":
            return _image_features(vlm, pv, mask)
        emb = vlm.model.vision_model.embeddings
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(emb), "forward", _old_embeddings_forward)
            return _image_features(vlm, pv, mask)


@pytest.mark.parametrize("mode", ["transformers", "trained"])
def test_vision_parity_with_padding_and_masks(tiny_vlm, graphs, mode):
    paths, _ = graphs
    sess = _session(paths[mode])
    pv, mask = _batch()
    ref = _torch_features(tiny_vlm, pv, mask, mode)
    out = sess.run(None, {"pixel_values": pv.numpy(), "pixel_attention_mask": mask.numpy()})[0]
    assert ref.shape == out.shape == (4, 4, 64)  # the all-zero tile is dropped
    assert np.abs(ref - out).max() < 1e-4
    # A batch of one image, and the modes really differ where the installed transformers computes
    # the 4.55-4.57 ids (a dropped (1 - 1e-6) factor would hide); on 5.x they are the same ids.
    one = sess.run(None, {"pixel_values": pv[:1].numpy(), "pixel_attention_mask": mask[:1].numpy()})[0]
    assert np.abs(one - ref[:1]).max() < 1e-4
    other = "trained" if mode == "transformers" else "transformers"
    apart = np.abs(_torch_features(tiny_vlm, pv[:1], mask[:1], other) - one).max()
    assert apart > 1e-3 if installed_position_ids(tiny_vlm) == "shrink" else apart < 1e-4


def test_installed_position_ids_follow_the_transformers_version(tiny_vlm):
    """4.55-4.57 compute the "shrink" ids (huggingface/transformers#41190), 5.x the trained ones;
    the probe runs transformers' own embedding forward, so it tells them apart by behaviour."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    want = "trained" if major >= 5 or (major, minor) < (4, 55) else "shrink"
    assert installed_position_ids(tiny_vlm) == want


def test_vision_all_padding_keeps_first_image(tiny_vlm, graphs):
    paths, _ = graphs
    pv = torch.zeros(2, 3, 32, 32)
    mask = torch.zeros(2, 32, 32, dtype=torch.bool)
    mask[0] = True
    ref = _torch_features(tiny_vlm, pv, mask, "transformers")
    out = _session(paths["transformers"]).run(None, {"pixel_values": pv.numpy(), "pixel_attention_mask": mask.numpy()})[
        0
    ]
    assert ref.shape == out.shape == (1, 4, 64)
    assert np.abs(ref - out).max() < 1e-4


def test_vision_graph_io_and_info(tiny_vlm, graphs):
    paths, infos = graphs
    m = onnx.load(str(paths["transformers"]))
    ins = {i.name: i.type.tensor_type for i in m.graph.input}
    assert list(ins) == ["pixel_values", "pixel_attention_mask"]
    assert ins["pixel_values"].elem_type == onnx.TensorProto.FLOAT
    assert ins["pixel_attention_mask"].elem_type == onnx.TensorProto.BOOL
    assert [o.name for o in m.graph.output] == ["image_features"]
    assert m.opset_import[0].version == 23 or any(o.version == 23 for o in m.opset_import if o.domain == "")
    assert not any(p.key.startswith("pkg.torch") for n in m.graph.node for p in n.metadata_props)
    info = infos["transformers"]
    assert info["nodes"] == len(m.graph.node) and info["seconds"] > 0 and info["position_ids"] == "transformers"
    assert info["position_ids_arithmetic"] == installed_position_ids(tiny_vlm)
    assert infos["trained"]["position_ids_arithmetic"] == "trained"
    dims = vision_dims(tiny_vlm.config)
    assert dims == {
        "image_size": 32,
        "patch_size": 8,
        "scale_factor": 2,
        "image_seq_len": 4,
        "image_token_id": 250,
        "text_hidden_size": 64,
        "vision_hidden_size": 32,
    }
    assert info["image_seq_len"] == tiny_vlm.model.image_seq_len == 4


def test_embeddings_parity(tiny_vlm, graphs):
    paths, infos = graphs
    sess = _session(paths["embed"])
    emb = tiny_vlm.get_input_embeddings()
    for ids in (np.array([[1, 5, 250, 7, 255, 0]]), np.array([[3], [250]])):
        ref = emb(torch.from_numpy(ids)).detach().numpy()
        out = sess.run(None, {"input_ids": ids.astype(np.int64)})[0]
        assert out.shape == ref.shape and np.abs(out - ref).max() == 0.0
    m = onnx.load(str(paths["embed"]))
    names = [n.name for n in m.graph.node]
    assert EMBED_NODE in names
    assert [i.name for i in m.graph.initializer] == ["model.embed_tokens.weight"]
    assert [o.name for o in m.graph.output] == ["inputs_embeds"]
    assert infos["embed"]["nodes"] == len(m.graph.node) and infos["embed"]["hidden_size"] == 64
