"""SmolVLM / Idefics3 image preprocessing and prompt expansion, torch-free (numpy + Pillow).

A line-by-line port of transformers' slow ``SmolVLMImageProcessor`` (identical to
``Idefics3ImageProcessor``) and of ``SmolVLMProcessor``'s image-token expansion, so the runtime
feeds the vision graph exactly what transformers would:

1. inputs: a path is opened like ``transformers.image_utils.load_image`` (EXIF transpose, then
   ``convert("RGB")`` -- an RGBA file loses its alpha without compositing); a PIL image or an array
   is used as it is;
2. ``do_resize``: the longest edge becomes ``size["longest_edge"]`` (up *or* down), the other edge
   ``int(...)`` of the aspect ratio, rounded up to even, then capped at 4096;
3. ``do_image_splitting``: both edges go up to the next multiple of ``max_image_size["longest_edge"]``
   (M), the image is cut into M x M tiles (row-major) and, when there is more than one, followed by
   the whole image resized to M x M; ``rows``/``cols`` are the tile grid (0, 0 when not split).
   Without splitting, the image is resized to M x M;
4. every resize is a Pillow ``resize`` with ``resample`` (LANCZOS by default) on the uint8 array,
   single-channel arrays as mode "P" (so Pillow resizes them with NEAREST, as transformers does);
5. ``do_convert_rgb`` (after splitting): alpha-composite on white, to RGB (palette images get their
   palette back first); ``do_rescale`` (float64 multiply, then float32); ``do_normalize``;
6. ``do_pad``: zero-pad every tile to the largest tile (bottom/right) with a pixel mask.

Deliberate differences, only where transformers fails or garbles an input: a PIL image is always
taken as channels-last (transformers guesses channels-first for a 3- or 4-pixel-high image);
modes "LA"/"PA"/"La"/"RGBa" are converted to RGBA and other modes that are not
RGB/RGBA/L/P (CMYK, YCbCr, I;16, F, 1, ...) to RGB first, where transformers raises or treats
CMYK as RGBA.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import GenerationError

MAX_IMAGE_SIZE = 4096  # transformers' absolute cap on the resized longest edge
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)
LANCZOS = 1  # PIL.Image.Resampling.LANCZOS

IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"


def _pil():
    try:
        from PIL import Image, ImageOps
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise GenerationError("images need Pillow: pip install pillow") from e
    return Image, ImageOps


def image_seq_len(image_size: int, patch_size: int, scale_factor: int) -> int:
    """Image tokens per tile: ``(image_size // patch_size) ** 2 // scale_factor ** 2``."""
    return int(((image_size // patch_size) ** 2) / (scale_factor**2))


# ---------------------------------------------------------------------------------------------
# Sizes (verbatim arithmetic of image_processing_smolvlm.py)


def _rescale_to_max_len(height: int, width: int, min_len: int = 1, max_len: int | None = None) -> tuple[int, int]:
    max_len = max(height, width) if max_len is None else max_len
    aspect_ratio = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect_ratio)
        if height % 2 != 0:
            height += 1
    elif height > width:
        height = max_len
        width = int(height * aspect_ratio)
        if width % 2 != 0:
            width += 1
    return max(height, min_len), max(width, min_len)


def _scale_below_upper_bound(height: int, width: int, max_len: int | None = None) -> tuple[int, int]:
    max_len = max(height, width) if max_len is None else max_len
    aspect_ratio = width / height
    if width >= height and width > max_len:
        width = max_len
        height = int(width / aspect_ratio)
    elif height > width and height > max_len:
        height = max_len
        width = int(height * aspect_ratio)
    return max(height, 1), max(width, 1)


def resize_output_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """``get_resize_output_image_size``: longest edge to ``longest_edge``, capped at 4096."""
    height, width = _rescale_to_max_len(height, width, max_len=longest_edge)
    return _scale_below_upper_bound(height, width, max_len=MAX_IMAGE_SIZE)


def vision_encoder_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """``resize_for_vision_encoder``: both edges up to multiples of ``tile``."""
    aspect_ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = int(width / aspect_ratio)
        height = math.ceil(height / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = int(height * aspect_ratio)
        width = math.ceil(width / tile) * tile
    return height, width


# ---------------------------------------------------------------------------------------------
# numpy <-> PIL, as transformers' to_pil_image / resize / convert_to_rgb do it (channels-last)


def _to_uint8(arr: np.ndarray) -> np.ndarray:
    """``to_pil_image``'s rescale rule: uint8 as is; integral values in [0, 255] cast; floats in
    [0, 1] times 255 (truncated); anything else is an error."""
    if arr.dtype == np.uint8:
        return arr
    if np.allclose(arr, arr.astype(int)):
        if np.all(arr >= 0) and np.all(arr <= 255):
            return arr.astype(np.uint8)
        raise GenerationError(f"image values must lie in [0, 255], got [{arr.min()}, {arr.max()}]")
    if np.all(arr >= 0) and np.all(arr <= 1):  # rescale(image, 255): float64 product, float32, then uint8
        return (arr.astype(np.float64) * 255).astype(np.float32).astype(np.uint8)
    raise GenerationError(f"float image values must lie in [0, 1], got [{arr.min()}, {arr.max()}]")


def _to_pil(arr: np.ndarray, mode: str | None = None):
    Image, _ = _pil()
    if arr.shape[-1] == 1:
        arr = arr[..., 0]
    return Image.fromarray(_to_uint8(arr), mode=mode)


def _resize(arr: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """``SmolVLMImageProcessor.resize`` on an HxWxC array (C in 1, 3, 4)."""
    mode = "P" if arr.shape[-1] == 1 else None
    out = np.array(_to_pil(arr, mode).resize((width, height), resample=resample))
    return out[..., None] if out.ndim == 2 else out


def _convert_to_rgb(arr: np.ndarray, palette: list[int] | None) -> np.ndarray:
    Image, _ = _pil()
    img = _to_pil(arr, "P" if palette is not None else None)
    if img.mode == "P" and palette is not None:
        img.putpalette(palette)
    rgba = img.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255))
    return np.array(Image.alpha_composite(background, rgba).convert("RGB"))


# ---------------------------------------------------------------------------------------------


def _load_path(path: str | os.PathLike):
    """``load_image`` for a local file, with one clear error naming the file."""
    Image, ImageOps = _pil()
    p = Path(path)
    if not p.is_file():
        raise GenerationError(f"image file not found: {p}")
    try:
        with Image.open(p) as im:
            im.load()
            im = ImageOps.exif_transpose(im)
            return im.convert("RGB")
    except GenerationError:
        raise
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GenerationError(f"cannot read image {p}: {reason}") from e


def _as_array(image: Any, index: int) -> tuple[np.ndarray, list[int] | None]:
    """One input as a channels-last array (HxWxC, C in 1, 3, 4) and its palette (P images)."""
    Image, _ = _pil()
    if isinstance(image, (str, os.PathLike)):
        image = _load_path(image)
    if isinstance(image, Image.Image):
        if image.mode in ("LA", "PA", "La", "RGBa"):
            image = image.convert("RGBA")
        elif image.mode not in ("RGB", "RGBA", "L", "P"):
            image = image.convert("RGB")
        palette = image.getpalette() if image.mode == "P" else None
        arr = np.array(image)
    elif isinstance(image, np.ndarray):
        palette = None
        arr = image
        if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
            arr = arr.transpose(1, 2, 0)  # channels-first array
    else:
        raise GenerationError(
            f"image {index}: expected a path, a PIL image or a numpy array, got {type(image).__name__}"
        )
    if arr.ndim == 2:
        arr = arr[..., None]
    if arr.ndim != 3 or arr.shape[-1] not in (1, 3, 4) or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise GenerationError(
            f"image {index}: unsupported array shape {tuple(arr.shape)} (want HxW, HxWxC or CxHxW with C in 1, 3, 4)"
        )
    return arr, palette


def _size_dict(value: Any, name: str) -> dict[str, int]:
    if isinstance(value, int):
        return {"longest_edge": value}
    if isinstance(value, dict) and ("longest_edge" in value or ("height" in value and "width" in value)):
        return {k: int(v) for k, v in value.items()}
    raise GenerationError(
        f"preprocessor config: {name} must be {{'longest_edge': N}} or {{'height': H, 'width': W}}, got {value!r}"
    )


@dataclass
class SmolVLMImagePreprocessor:
    """``SmolVLMImageProcessor`` / ``Idefics3ImageProcessor`` (slow, PIL) without torch or transformers."""

    do_convert_rgb: bool = True
    do_resize: bool = True
    size: dict = field(default_factory=lambda: {"longest_edge": 4 * 364})
    resample: int = LANCZOS
    do_image_splitting: bool = True
    max_image_size: dict = field(default_factory=lambda: {"longest_edge": 364})
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: Any = IMAGENET_STANDARD_MEAN
    image_std: Any = IMAGENET_STANDARD_STD
    do_pad: bool = True

    @classmethod
    def from_dict(cls, config: dict) -> "SmolVLMImagePreprocessor":
        """From the keys of a saved ``preprocessor_config.json`` (unknown keys are ignored)."""
        kw: dict[str, Any] = {}
        for key in ("do_convert_rgb", "do_resize", "do_image_splitting", "do_rescale", "do_normalize", "do_pad"):
            if config.get(key) is not None:
                kw[key] = bool(config[key])
        if config.get("size") is not None:
            kw["size"] = _size_dict(config["size"], "size")
        if config.get("max_image_size") is not None:
            kw["max_image_size"] = _size_dict(config["max_image_size"], "max_image_size")
            if "longest_edge" not in kw["max_image_size"]:
                raise GenerationError("preprocessor config: max_image_size needs 'longest_edge'")
        if config.get("resample") is not None:
            kw["resample"] = _resample(config["resample"])
        if config.get("rescale_factor") is not None:
            kw["rescale_factor"] = float(config["rescale_factor"])
        for key in ("image_mean", "image_std"):
            if config.get(key) is not None:
                v = config[key]
                kw[key] = tuple(float(x) for x in v) if isinstance(v, (list, tuple)) else float(v)
        return cls(**kw)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "SmolVLMImagePreprocessor":
        import json

        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict:
        return {
            "do_convert_rgb": self.do_convert_rgb,
            "do_resize": self.do_resize,
            "size": dict(self.size),
            "resample": int(self.resample),
            "do_image_splitting": self.do_image_splitting,
            "max_image_size": dict(self.max_image_size),
            "do_rescale": self.do_rescale,
            "rescale_factor": self.rescale_factor,
            "do_normalize": self.do_normalize,
            "image_mean": list(self.image_mean) if isinstance(self.image_mean, (list, tuple)) else self.image_mean,
            "image_std": list(self.image_std) if isinstance(self.image_std, (list, tuple)) else self.image_std,
            "do_pad": self.do_pad,
        }

    # -- the steps --------------------------------------------------------------------------

    def _resize_longest(self, arr: np.ndarray) -> np.ndarray:
        h, w = arr.shape[:2]
        if "longest_edge" in self.size:
            nh, nw = resize_output_size(h, w, self.size["longest_edge"])
        else:
            nh, nw = self.size["height"], self.size["width"]
        return _resize(arr, nh, nw, self.resample)

    def _split(self, arr: np.ndarray) -> tuple[list[np.ndarray], int, int]:
        """``resize_for_vision_encoder`` + ``split_image``."""
        tile = self.max_image_size["longest_edge"]
        h, w = arr.shape[:2]
        nh, nw = vision_encoder_size(h, w, tile)
        arr = _resize(arr, nh, nw, self.resample)
        height, width = arr.shape[:2]
        frames: list[np.ndarray] = []
        if height > tile or width > tile:
            rows, cols = math.ceil(height / tile), math.ceil(width / tile)
            oh, ow = math.ceil(height / rows), math.ceil(width / cols)
            for r in range(rows):
                for c in range(cols):
                    y0, x0 = r * oh, c * ow
                    frames.append(arr[y0 : min(y0 + oh, height), x0 : min(x0 + ow, width), :])
            if height != tile or width != tile:
                arr = _resize(arr, tile, tile, self.resample)
        else:
            rows, cols = 0, 0
        frames.append(arr)
        return frames, rows, cols

    def _normalize(self, arr: np.ndarray) -> np.ndarray:
        if not np.issubdtype(arr.dtype, np.floating):
            arr = arr.astype(np.float32)
        c = arr.shape[-1]

        def vec(v, name):
            v = list(v) if isinstance(v, (list, tuple)) else [v] * c
            if len(v) != c:
                raise GenerationError(f"{name} has {len(v)} values for a {c}-channel image")
            return np.array(v, dtype=arr.dtype)

        return (arr - vec(self.image_mean, "image_mean")) / vec(self.image_std, "image_std")

    def __call__(self, images: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, list[int], list[int]]:
        """``images`` (paths, PIL images or arrays) -> ``(pixel_values [n_tiles, 3, h, w] float32,
        pixel_attention_mask [n_tiles, h, w] bool, rows, cols)``; one rows/cols entry per image,
        tiles in image order (each image's grid row-major, then its global view)."""
        if not isinstance(images, (list, tuple)):
            images = [images]
        tile = self.max_image_size["longest_edge"]
        if not images:
            return (np.zeros((0, 3, tile, tile), np.float32), np.zeros((0, tile, tile), bool), [], [])
        frames: list[np.ndarray] = []
        palettes: list[list[int] | None] = []
        rows: list[int] = []
        cols: list[int] = []
        for i, image in enumerate(images):
            arr, palette = _as_array(image, i)
            if self.do_resize:
                arr = self._resize_longest(arr)
            if self.do_image_splitting:
                split, r, c = self._split(arr)
            else:
                split, r, c = [_resize(arr, tile, tile, self.resample)], 0, 0
            frames.extend(split)
            palettes.extend([palette] * len(split))
            rows.append(r)
            cols.append(c)
        if self.do_convert_rgb:
            frames = [_convert_to_rgb(f, p) for f, p in zip(frames, palettes)]
        if self.do_rescale:
            frames = [(f.astype(np.float64) * self.rescale_factor).astype(np.float32) for f in frames]
        if self.do_normalize:
            frames = [self._normalize(f) for f in frames]
        channels = {f.shape[-1] for f in frames}
        if channels != {3}:
            raise GenerationError(f"images must end up with 3 channels, got {sorted(channels)} (enable do_convert_rgb)")
        if self.do_pad:
            ph = max(f.shape[0] for f in frames)
            pw = max(f.shape[1] for f in frames)
        else:
            sizes = {f.shape[:2] for f in frames}
            if len(sizes) != 1:
                raise GenerationError(f"do_pad is off but the tiles differ in size: {sorted(sizes)}")
            ph, pw = next(iter(sizes))
        pixel_values = np.zeros((len(frames), 3, ph, pw), dtype=np.float32)
        mask = np.zeros((len(frames), ph, pw), dtype=bool)
        for k, f in enumerate(frames):
            h, w = f.shape[:2]
            pixel_values[k, :, :h, :w] = f.transpose(2, 0, 1)
            mask[k, :h, :w] = True
        return pixel_values, mask, rows, cols


def _resample(value: Any) -> int:
    names = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}
    if isinstance(value, str):
        key = value.lower().split(".")[-1]
        if key in names:
            return names[key]
        raise GenerationError(f"preprocessor config: unknown resample {value!r}")
    v = int(value)
    if v not in names.values():
        raise GenerationError(f"preprocessor config: unknown resample {value!r}")
    return v


# ---------------------------------------------------------------------------------------------
# Prompt expansion (processing_smolvlm.py: _prompt_split_image / _prompt_single_image)


def image_prompt_string(
    rows: int,
    cols: int,
    *,
    image_seq_len: int,
    image_token: str = IMAGE_TOKEN,
    fake_image_token: str = FAKE_IMAGE_TOKEN,
    global_image_token: str = GLOBAL_IMAGE_TOKEN,
) -> str:
    """The text that replaces one ``<image>``: ``get_image_prompt_string``."""
    if rows == 0 and cols == 0:
        return f"{fake_image_token}{global_image_token}{image_token * image_seq_len}{fake_image_token}"
    text = ""
    for r in range(rows):
        for c in range(cols):
            text += f"{fake_image_token}<row_{r + 1}_col_{c + 1}>" + image_token * image_seq_len
        text += "\n"
    text += f"\n{fake_image_token}{global_image_token}{image_token * image_seq_len}{fake_image_token}"
    return text


def expand_image_tokens(
    text: str,
    rows: Sequence[int],
    cols: Sequence[int],
    *,
    image_seq_len: int,
    image_token: str = IMAGE_TOKEN,
    fake_image_token: str = FAKE_IMAGE_TOKEN,
    global_image_token: str = GLOBAL_IMAGE_TOKEN,
) -> str:
    """Replace the i-th ``image_token`` of ``text`` by image i's prompt string
    (``SmolVLMProcessor.expand_text_with_image_tokens`` for one sample)."""
    if len(rows) != len(cols):
        raise GenerationError(f"rows ({len(rows)}) and cols ({len(cols)}) differ in length")
    parts = text.split(image_token)
    if len(parts) - 1 != len(rows):
        raise GenerationError(
            f"the prompt has {len(parts) - 1} {image_token} token(s) but {len(rows)} image(s) were given"
        )
    out = parts[0]
    for i, (r, c) in enumerate(zip(rows, cols)):
        out += (
            image_prompt_string(
                r,
                c,
                image_seq_len=image_seq_len,
                image_token=image_token,
                fake_image_token=fake_image_token,
                global_image_token=global_image_token,
            )
            + parts[i + 1]
        )
    return out
