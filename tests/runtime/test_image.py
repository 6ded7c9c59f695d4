"""Torch-free SmolVLM image preprocessing and prompt expansion vs transformers."""

import ast
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from dejavuu_build.errors import GenerationError
from dejavuu_build.runtime.image import SmolVLMImagePreprocessor, expand_image_tokens, image_seq_len

pytest.importorskip("transformers")
from dejavuu_build.transformers_compat import pil_image_processor_class

# transformers' PIL SmolVLM image processor (SmolVLMImageProcessor on 4.x, SmolVLMImageProcessorPil
# on 5.x, where the plain name needs torchvision): what runtime/image.py ports.
HFImageProcessor = pil_image_processor_class()
# transformers 5.x converts every image to RGB when it loads it, before resizing and splitting;
# 4.x (what runtime/image.py ports) resizes grayscale / palette images as they are and composites
# alpha after splitting. RGB inputs give the same pixels on both.
RGB_FIRST = int(__import__("transformers").__version__.split(".")[0]) >= 5
NOT_RGB = ("gray", "rgba", "palette")


def _skip_if_rgb_first(why: str) -> None:
    if RGB_FIRST:
        pytest.skip(f"transformers 5.x converts to RGB before resizing ({why}); runtime/image.py follows 4.x")


CONFIGS = {
    "split": dict(size={"longest_edge": 96}, max_image_size={"longest_edge": 32}),
    "nosplit": dict(size={"longest_edge": 96}, max_image_size={"longest_edge": 32}, do_image_splitting=False),
    "one-tile": dict(size={"longest_edge": 32}, max_image_size={"longest_edge": 32}),  # rows = cols = 0
    "odd": dict(
        size={"longest_edge": 70},
        max_image_size={"longest_edge": 24},
        image_mean=[0.48, 0.45, 0.4],
        image_std=[0.26, 0.26, 0.27],
        resample=3,
    ),
}


def _rgb(w, h, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _images():
    rng = np.random.default_rng(7)
    ims = {
        f"rgb{w}x{h}": _rgb(w, h, w * 1000 + h)
        for w, h in [(100, 150), (150, 100), (31, 200), (64, 64), (20, 20), (33, 97)]
    }
    ims["gray"] = Image.fromarray(rng.integers(0, 256, (50, 70), dtype=np.uint8), mode="L")
    ims["rgba"] = Image.fromarray(rng.integers(0, 256, (90, 40, 4), dtype=np.uint8), mode="RGBA")
    pal = Image.fromarray(rng.integers(0, 256, (45, 61, 3), dtype=np.uint8)).convert("P", palette=Image.ADAPTIVE)
    ims["palette"] = pal
    return ims


IMAGES = _images()


def _compare(cfg, images, hf_images=None):
    hf = HFImageProcessor(**cfg)
    ours = SmolVLMImagePreprocessor.from_dict(hf.to_dict())
    # channels_last: transformers infers the layout from the first image *before* adding the channel
    # axis of 2-D (L / P) images, and raises on a grayscale first image without this hint.
    ref = hf(
        hf_images if hf_images is not None else images,
        return_tensors="np",
        return_row_col_info=True,
        input_data_format="channels_last",
    )
    pv, mask, rows, cols = ours(images)
    assert pv.dtype == np.float32 and mask.dtype == bool
    assert pv.shape == ref["pixel_values"].shape[1:]
    assert np.abs(pv - ref["pixel_values"][0]).max() < 1e-5
    assert np.array_equal(mask, ref["pixel_attention_mask"][0].astype(bool))
    assert rows == ref["rows"][0] and cols == ref["cols"][0]
    return pv, mask, rows, cols


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("name", list(IMAGES))
def test_matches_transformers_per_image(cfg, name):
    if name in NOT_RGB:
        _skip_if_rgb_first(f"a {name} image")
    _compare(CONFIGS[cfg], [IMAGES[name]])


@pytest.mark.parametrize("cfg", ["split", "nosplit"])
def test_matches_transformers_several_images(cfg):
    _skip_if_rgb_first("gray and rgba images among them")
    ims = [IMAGES["rgb100x150"], IMAGES["gray"], IMAGES["rgb20x20"], IMAGES["rgba"]]
    pv, _, rows, cols = _compare(CONFIGS[cfg], ims)
    if cfg == "split":
        assert rows == [3, 3, 3, 3] and cols == [2, 3, 3, 2]  # 100x150, 70x50, 20x20 (upscaled), 40x90
        assert pv.shape[0] == sum(r * c + 1 for r, c in zip(rows, cols))
    else:
        assert rows == cols == [0, 0, 0, 0] and pv.shape[0] == 4


def test_arrays_and_paths_match_transformers(tmp_path):
    rng = np.random.default_rng(3)
    hwc = rng.integers(0, 256, (40, 55, 3), dtype=np.uint8)
    _compare(CONFIGS["split"], [hwc])
    if not RGB_FIRST:  # 5.x rescales float arrays by 1/255 again; 4.x (and the port) takes [0, 1] as rescaled
        _compare(CONFIGS["split"], [hwc.astype(np.float32) / 255.0])  # floats in [0, 1]
    # Paths: transformers loads them with EXIF transpose + convert("RGB") (alpha dropped, not composited).
    rgba_png = tmp_path / "a.png"
    IMAGES["rgba"].save(rgba_png)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 on display
    jpg = tmp_path / "b.jpg"
    _rgb(60, 30, 1).save(jpg, exif=exif)
    _, _, rows, cols = _compare(CONFIGS["split"], [rgba_png, str(jpg)], hf_images=[str(rgba_png), str(jpg)])
    assert (rows, cols) == ([3, 3], [2, 2])  # the JPEG is portrait once rotated


def test_from_dict_of_a_saved_config():
    cfg = {
        "do_convert_rgb": True,
        "do_image_splitting": True,
        "do_normalize": True,
        "do_pad": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "SmolVLMImageProcessor",
        "image_std": [0.5, 0.5, 0.5],
        "max_image_size": {"longest_edge": 512},
        "processor_class": "SmolVLMProcessor",
        "resample": 1,
        "rescale_factor": 0.00392156862745098,
        "size": {"longest_edge": 2048},
        "video_sampling": {"fps": 1, "max_frames": 64},
    }
    p = SmolVLMImagePreprocessor.from_dict(cfg)
    assert p.size == {"longest_edge": 2048} and p.max_image_size == {"longest_edge": 512} and p.resample == 1
    hf = HFImageProcessor(**{k: v for k, v in cfg.items() if k != "video_sampling"})
    im = _rgb(700, 300, 5)
    ref = hf([im], return_tensors="np", return_row_col_info=True)
    pv, mask, rows, cols = p([im])
    assert np.abs(pv - ref["pixel_values"][0]).max() < 1e-5 and mask.all()
    assert (rows, cols) == (ref["rows"][0], ref["cols"][0]) == ([2], [4])


def test_bad_images_give_one_line_errors(tmp_path):
    p = SmolVLMImagePreprocessor.from_dict(CONFIGS["split"])
    bad = tmp_path / "not_an_image.png"
    bad.write_bytes(b"this is not a png")
    with pytest.raises(GenerationError, match="not_an_image.png") as e:
        p([bad])
    assert "\n" not in str(e.value)
    truncated = tmp_path / "truncated.png"
    _rgb(40, 40, 2).save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:60])
    with pytest.raises(GenerationError, match="truncated.png"):
        p([truncated])
    with pytest.raises(GenerationError, match="missing.jpg"):
        p([tmp_path / "missing.jpg"])
    with pytest.raises(GenerationError, match="unsupported array shape"):
        p([np.zeros((10, 10, 2), np.uint8)])
    with pytest.raises(GenerationError, match="expected a path"):
        p([42])


# ---------------------------------------------------------------------------------------------
# Prompt expansion: the real functions from processing_smolvlm.py, loaded from its source (importing
# the module needs torchvision, which this machine lacks).


def _processor_functions():
    import transformers

    src_path = Path(transformers.__file__).parent / "models" / "smolvlm" / "processing_smolvlm.py"
    tree = ast.parse(src_path.read_text())
    wanted = {"_prompt_split_image", "_prompt_single_image", "get_image_prompt_string"}
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SmolVLMProcessor")
    # 4.x: one method expands a whole text; 5.x: ProcessorMixin replaces each image token by
    # replace_image_token's string
    methods = {"expand_text_with_image_tokens", "replace_image_token"}
    body += [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in methods]
    assert len(body) == 4
    ns: dict = {}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(src_path), "exec"), ns)
    return ns


def test_prompt_expansion_matches_processor_source():
    ns = _processor_functions()
    self = SimpleNamespace(
        image_seq_len=4,
        image_token="<image>",
        fake_image_token="<fake_token_around_image>",
        global_image_token="<global-img>",
    )
    text = "User:<image>What is in these<image> two? And<image><end_of_utterance>\nAssistant:"
    rows, cols = [3, 0, 1], [2, 0, 4]
    if "expand_text_with_image_tokens" in ns:
        ref = ns["expand_text_with_image_tokens"](self, [text], image_rows=[rows], image_cols=[cols])[0]
    else:
        first, *rest = text.split("<image>")
        grid = {"rows": [rows], "cols": [cols]}
        ref = first + "".join(ns["replace_image_token"](self, grid, i) + t for i, t in enumerate(rest))
    assert expand_image_tokens(text, rows, cols, image_seq_len=4) == ref
    for r, c in [(0, 0), (1, 1), (2, 3), (4, 4)]:
        ref = ns["get_image_prompt_string"](
            r, c, 64, fake_token_around_image="<F>", image_token="<I>", global_image_token="<G>"
        )
        assert (
            expand_image_tokens(
                "<I>", [r], [c], image_seq_len=64, image_token="<I>", fake_image_token="<F>", global_image_token="<G>"
            )
            == ref
        )


def test_prompt_expansion_hand_checked():
    got = expand_image_tokens("A<image>B", [2], [1], image_seq_len=2)
    assert got == (
        "A<fake_token_around_image><row_1_col_1><image><image>\n"
        "<fake_token_around_image><row_2_col_1><image><image>\n"
        "\n<fake_token_around_image><global-img><image><image><fake_token_around_image>B"
    )
    got = expand_image_tokens("<image>x", [0], [0], image_seq_len=3)
    assert got == "<fake_token_around_image><global-img><image><image><image><fake_token_around_image>x"
    assert expand_image_tokens("no images", [], [], image_seq_len=3) == "no images"
    with pytest.raises(GenerationError, match="1 <image> token"):
        expand_image_tokens("<image>", [0, 0], [0, 0], image_seq_len=3)
    assert image_seq_len(512, 16, 4) == 64 and image_seq_len(384, 14, 3) == 81 and image_seq_len(32, 8, 2) == 4


def test_module_is_torch_free():
    code = (
        "import sys, dejavuu_build.runtime.image as m; "
        "bad = [k for k in ('torch', 'transformers', 'onnx') if k in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_modes_transformers_cannot_take_are_converted_first():
    """LA -> RGBA and CMYK -> RGB before processing (transformers raises on LA, reads CMYK as RGBA)."""
    p = SmolVLMImagePreprocessor.from_dict(CONFIGS["split"])
    rng = np.random.default_rng(11)
    la = Image.fromarray(rng.integers(0, 256, (30, 44, 2), dtype=np.uint8), mode="LA")
    cmyk = _rgb(44, 30, 4).convert("CMYK")
    for im, as_ in ((la, "RGBA"), (cmyk, "RGB")):
        a, b = p([im]), p([im.convert(as_)])
        assert np.array_equal(a[0], b[0]) and a[2:] == b[2:]
