"""Tiny random models of every registered recipe, saved as local HF folders (tests only)."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer(vocab_size: int = 256):
    """A byte-level BPE-free tokenizer: one token per byte-ish character, plus specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "<|im_end|>", "<|im_start|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    n = len(vocab)
    for i in range(n, vocab_size):   # filler tokens so ids cover the model's vocab
        vocab[f"<extra_{i}>"] = i
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                                   eos_token="<|im_end|>", pad_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny(recipe_name: str, folder: Path, seed: int = 0) -> Path:
    from dejavuu_build.recipes import registered

    r = registered()[recipe_name]()
    model = r.tiny_model(seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tiny_tokenizer(r.text_config(model.config).vocab_size).save_pretrained(folder)
    return folder
