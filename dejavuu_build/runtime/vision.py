"""The vision side of a VLM build: token embedding, vision encoder, image-token splicing.

Torch-free: onnxruntime, numpy and (for images) Pillow. Files written by `dejavuu-build vlm`:
``embed_tokens.onnx`` (input_ids -> inputs_embeds), ``vision_encoder.onnx`` (pixel_values,
pixel_attention_mask -> image_features), ``preprocessor_config.json``, ``vlm.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..errors import CacheError, GenerationError
from ..schema import EMBED_FILE, PREPROCESSOR_FILE, VISION_FILE, VLM_FILE

if TYPE_CHECKING:
    from .image import SmolVLMImagePreprocessor


def load_embedder(folder: Path, threads: int | None = None) -> Callable[[np.ndarray], np.ndarray]:
    """ids [1, N] -> embeds [1, N, H] through the build's own embedding graph."""
    from .session import make_session

    path = Path(folder) / EMBED_FILE
    if not path.is_file():
        raise CacheError(f"{folder} has no {EMBED_FILE} for its inputs_embeds decoder; rebuild it")
    sess = make_session(path, threads)
    name = sess.get_inputs()[0].name

    def embed(ids: np.ndarray) -> np.ndarray:
        return sess.run(None, {name: np.asarray(ids, dtype=np.int64)})[0]

    return embed


@dataclass
class VisionParts:
    session: Any  # the vision encoder's onnxruntime InferenceSession
    pre: SmolVLMImagePreprocessor
    cfg: dict  # vlm.json: image_token_id, image_seq_len, tokens, ...

    @classmethod
    def load(cls, folder: Path, threads: int | None = None) -> "VisionParts":
        from .image import SmolVLMImagePreprocessor
        from .session import make_session

        folder = Path(folder)
        for f in (VISION_FILE, VLM_FILE, PREPROCESSOR_FILE):
            if not (folder / f).is_file():
                raise CacheError(f"{folder} has no {f}; rebuild it with `dejavuu-build vlm --name {folder.name}`")
        return cls(
            make_session(folder / VISION_FILE, threads),
            SmolVLMImagePreprocessor.from_file(folder / PREPROCESSOR_FILE),
            json.loads((folder / VLM_FILE).read_text()),
        )

    def prompt_text(self, prompt, n_images: int, tokenizer) -> str:
        """The chat-templated text with one image placeholder per image."""
        tok = self.cfg.get("image_token", "<image>")
        if isinstance(prompt, str):
            if tok in prompt:
                text = prompt
            elif tokenizer.template:
                content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": prompt}]
                text = tokenizer.apply_chat_template([{"role": "user", "content": content}])
            else:
                text = tok * n_images + prompt
        else:
            text = tokenizer.apply_chat_template(list(prompt))
        found = text.count(tok)
        if found != n_images:
            raise GenerationError(f"the prompt has {found} image placeholders but {n_images} images were given")
        return text

    def prefill(self, prompt, images: Sequence, tokenizer, embed) -> tuple[list[int], np.ndarray]:
        """(input ids with expanded image tokens, prompt embeddings with image features spliced in)."""
        from .image import expand_image_tokens

        text = self.prompt_text(prompt, len(images), tokenizer)
        pv, mask, rows, cols = self.pre(list(images))
        c = self.cfg
        text = expand_image_tokens(
            text,
            rows,
            cols,
            image_seq_len=c["image_seq_len"],
            image_token=c.get("image_token", "<image>"),
            fake_image_token=c.get("fake_image_token", "<fake_token_around_image>"),
            global_image_token=c.get("global_image_token", "<global-img>"),
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
        feats = self.session.run(None, {"pixel_values": pv.astype(np.float32), "pixel_attention_mask": mask})[0]
        arr = np.asarray(ids, dtype=np.int64)
        slots = arr == c["image_token_id"]
        if int(slots.sum()) != feats.shape[0] * feats.shape[1]:
            raise GenerationError(
                f"{int(slots.sum())} image-token slots for {feats.shape[0]} tiles × "
                f"{feats.shape[1]} features: the tokenizer does not know the image tokens"
            )
        emb = embed(arr[None]).copy()
        emb[0, slots] = feats.reshape(-1, feats.shape[-1])
        return ids, emb
