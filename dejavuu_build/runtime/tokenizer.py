"""Tokenizer and chat template without transformers: `tokenizers` + jinja2."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CacheError, GenerationError


class TextTokenizer:
    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CacheError(f"{folder} has no tokenizer.json; rebuild it with `dejavuu-build tree-decoder`")
        self.tok = Tokenizer.from_file(str(path))
        cfg = {}
        if (folder / "tokenizer_config.json").is_file():
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
        self.template = None
        if (folder / "chat_template.jinja").is_file():
            self.template = (folder / "chat_template.jinja").read_text()
        elif isinstance(cfg.get("chat_template"), str):
            self.template = cfg["chat_template"]

        def special(key):
            v = cfg.get(key)
            return v.get("content") if isinstance(v, dict) else v

        self.bos_token = special("bos_token")
        self.eos_token = special("eos_token")
        self.add_bos = bool(cfg.get("add_bos_token", False))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.template:
            raise GenerationError("this model has no chat template: pass a plain prompt instead of --chat/messages")
        import jinja2

        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(msg):
            raise GenerationError(f"chat template: {msg}")

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)
