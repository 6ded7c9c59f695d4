"""Tiny random models of every registered recipe, saved as local HF folders (tests only)."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


VLM_TOKENS = {
    "<end_of_utterance>": 247,
    "<fake_token_around_image>": 248,
    "<global-img>": 249,
    "<image>": 250,
    "<row_1_col_1>": 251,
    "<row_1_col_2>": 252,
    "<row_2_col_1>": 253,
    "<row_2_col_2>": 254,
}
VLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}: "
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def tiny_tokenizer(vocab_size: int = 256, vlm: bool = False):
    """A byte-level BPE-free tokenizer: one token per byte-ish character, plus specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "<|im_end|>", "<|im_start|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    n = len(vocab)
    extra = {v: k for k, v in VLM_TOKENS.items()} if vlm else {}
    for i in range(n, vocab_size):  # filler tokens so ids cover the model's vocab
        vocab[extra.get(i, f"<extra_{i}>")] = i
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"] + (list(VLM_TOKENS) if vlm else [])})
    fast.chat_template = VLM_TEMPLATE if vlm else CHAT_TEMPLATE
    return fast


def save_tiny(recipe_name: str, folder: Path, seed: int = 0) -> Path:
    from dejavuu_build.recipes import registered

    r = registered()[recipe_name]()
    model = r.tiny_model(seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    vlm = getattr(r, "vlm", False)
    tok = tiny_tokenizer(r.text_config(model.config).vocab_size, vlm=vlm)
    if vlm:
        assert tok.convert_tokens_to_ids("<image>") == model.config.image_token_id
        from dejavuu_build.transformers_compat import pil_image_processor_class

        ip = pil_image_processor_class()  # the PIL one on every transformers (5.x's default needs torchvision)
        ip(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def llama_gguf_shapes(v: int, h: int, layers: int, heads: int, kv: int, ff: int) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes of a Llama-architecture GGUF (what the GGUF sources' tests write)."""
    shapes = {"token_embd.weight": (v, h), "output_norm.weight": (h,), "output.weight": (v, h)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (h,),
            f"blk.{i}.attn_q.weight": (h, h),
            f"blk.{i}.attn_k.weight": (h // heads * kv, h),
            f"blk.{i}.attn_v.weight": (h // heads * kv, h),
            f"blk.{i}.attn_output.weight": (h, h),
            f"blk.{i}.ffn_norm.weight": (h,),
            f"blk.{i}.ffn_gate.weight": (ff, h),
            f"blk.{i}.ffn_up.weight": (ff, h),
            f"blk.{i}.ffn_down.weight": (h, ff),
        }
    return shapes


def add_llama_hparams(w, *, vocab: int, h: int, layers: int, heads: int, kv: int, ff: int, context: int) -> None:
    """The hyper-parameters of a Llama GGUF (a ``gguf.GGUFWriter``) that the GGUF sources' and the
    llama.cpp peer's tests write, beside ``llama_gguf_shapes``' tensors."""
    w.add_context_length(context)
    w.add_embedding_length(h)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(h // heads)
    w.add_vocab_size(vocab)


def tiny_llama_gguf(path: Path, chat: bool = True, head_size: int = 32) -> Path:
    """Two Llama layers (2 heads of ``head_size`` over 1 KV head: hidden 64 by default) in Q4_1
    blocks, an fp32 norm and embedding, a byte-level BPE of the lowercase letters and a few merges,
    and a chat template (``chat=False``: none, as a base model's GGUF). ``head_size=64``: a head
    our attention operator takes (kernels.attn.HEAD_SIZES)."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    rng = np.random.default_rng(7)
    heads, kv, layers, ff = 2, 1, 2, 128
    h = heads * head_size
    letters = list("abcdefghijklmnopqrstuvwxyz")
    tokens = ["<unk>", "<|im_start|>", "<|im_end|>", *letters, "Ġ", "he", "ll", "hell", "hello", "Ġw", "Ġwo", "Ġwor"]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "Ġwo r"]
    w = gguf.GGUFWriter(str(path), "llama")
    add_llama_hparams(w, vocab=len(tokens), h=h, layers=layers, heads=heads, kv=kv, ff=ff, context=512)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    if chat:
        w.add_chat_template(
            "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>{% endif %}"
        )
    for name, shape in llama_gguf_shapes(len(tokens), h, layers, heads, kv, ff).items():
        x = (rng.standard_normal(shape) * (1.0 if len(shape) == 1 else 0.08)).astype(np.float32)
        if len(shape) == 1 or name == "token_embd.weight":
            w.add_tensor(name, x)
        else:
            q = quantize(x, gguf.GGMLQuantizationType.Q4_1)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def optimized_nodes(path: Path, tmp: Path) -> dict[str, int]:
    """The nodes onnxruntime runs: its ORT_ENABLE_ALL graph, written out and counted."""
    from collections import Counter

    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(tmp / "optimized.onnx")
    so.log_severity_level = 3
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return dict(Counter(n.op_type for n in onnx.load(str(tmp / "optimized.onnx"), load_external_data=False).graph.node))
