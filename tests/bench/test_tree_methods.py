"""`<method>+tree`: tree verification beside the chain run of the same method, on the same prompts."""

import pytest

from dejavuu_build.bench.config import BenchConfig, BenchError, Prompt, base_method
from dejavuu_build.bench.runner import DrafterPool


def test_tree_methods_are_accepted_and_get_their_own_drafter():
    cfg = BenchConfig(model="m", methods=("suffix_decoding", "suffix_decoding+tree", "asam+tree"))
    assert cfg.methods == ("baseline", "suffix_decoding", "suffix_decoding+tree", "asam+tree")
    assert base_method("asam+tree") == "asam" and base_method("pld") == "pld"
    corpus = [Prompt("1", "qa", "qa", ("a b c",)), Prompt("2", "rag", "rag", ("d e f",))]
    pool = DrafterPool(cfg, lambda t: [ord(c) for c in t], corpus)
    chain, tree = pool.get("suffix_decoding", "qa"), pool.get("suffix_decoding+tree", "qa")
    # a drafter that learns from earlier outputs must not see the chain run's answer to this prompt
    assert chain is not tree and type(chain) is type(tree)
    assert pool.get("suffix_decoding+tree", "qa") is tree
    with pytest.raises(BenchError, match="unknown method"):
        BenchConfig(model="m", methods=("nope+tree",))
