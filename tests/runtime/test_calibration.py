"""Machine-local exactness calibration: measured, cached, validated when read, and obeyed."""

import json
import logging

import numpy as np
import pytest

from dejavuu_build.runtime import calibration as C
from dejavuu_build.runtime import load

PROMPT = "the cat sat on the mat. the cat sat on the"


@pytest.mark.parametrize("variant", ["int4", "int4-static"])
def test_measured_on_this_machine(tiny_llama, variant):
    m = load(tiny_llama, variant=variant)
    cal = C.calibrate(m.decoder)
    assert cal.chain_exact is True
    assert cal.period in C.PERIODS and cal.tile in C.TILES


def test_invalid_records_are_measured_again(tiny_llama, cache_dir, caplog):
    """A period of 0 (or any value this code would not write) is not trusted: it is re-measured
    and the record rewritten, instead of looping forever on a zero-width layout."""
    m = load(tiny_llama, variant="int4")
    key = C.calibration_key(m.manifest.variants["int4"].sha256, 2)
    f = cache_dir / ".runtime" / f"calibration-{key}.json"
    f.parent.mkdir(parents=True, exist_ok=True)
    for bad in (
        {"version": C.CALIBRATION_VERSION, "chain_exact": True, "period": 0, "tile": None},
        {"version": C.CALIBRATION_VERSION, "chain_exact": "yes", "period": 16, "tile": None},
        {"version": C.CALIBRATION_VERSION, "chain_exact": True, "period": 16, "tile": 40},
        "not json {",
    ):
        f.write_text(bad if isinstance(bad, str) else json.dumps(bad))
        m = load(tiny_llama, variant="int4")
        with caplog.at_level(logging.WARNING, logger="dejavuu"):
            assert m.tree_period in C.PERIODS
        assert "invalid exactness calibration" in caplog.text
        caplog.clear()
        assert C.Calibration.from_json(json.loads(f.read_text())).period == m.tree_period


def test_cached_record_is_used(tiny_llama, cache_dir):
    m = load(tiny_llama, variant="int4")
    key = C.calibration_key(m.manifest.variants["int4"].sha256, 2)
    f = cache_dir / ".runtime" / f"calibration-{key}.json"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps({"version": C.CALIBRATION_VERSION, "chain_exact": True, "period": 32, "tile": 64}))
    m = load(tiny_llama, variant="int4")
    assert (m.tree_period, m.calibration.tile) == (32, 64)
    f.unlink()


def test_a_machine_without_exact_batches_decodes_plainly(tiny_llama, caplog):
    """If batched verification is not bit-identical here, drafts are not used (exact, slower) and
    the user is told once."""
    m = load(tiny_llama, variant="int4")
    m._calibration = C.Calibration(chain_exact=False, period=None, tile=None)
    base = m.generate(PROMPT, max_new_tokens=24)
    with caplog.at_level(logging.WARNING, logger="dejavuu"):
        r = m.generate(PROMPT, method="pld", tree=True, max_new_tokens=24)
        m.generate(PROMPT, method="pld", max_new_tokens=24)
    assert r.tokens == base.tokens and r.stats.drafted == 0 and not r.tree
    assert caplog.text.count("decoding plainly") == 1


def test_the_build_measured_it_and_the_first_load_measures_nothing(tiny_llama, cache_dir, monkeypatch):
    """The build stores the default variant's calibration in the manifest and in the runtime's
    cache under the file's sha256: loading it then measures nothing (calibrate would raise)."""
    from dejavuu_build import schema as S

    man = S.read_manifest(tiny_llama)
    rec = man.variants[man.default_variant]  # what the build calibrates: the default (int4-static)
    key = C.calibration_key(rec.sha256, 2)
    assert rec.calibration["key"] == key and rec.calibration["chain_exact"] is True
    stored = json.loads((cache_dir / ".runtime" / f"calibration-{key}.json").read_text())
    assert {k: stored[k] for k in ("chain_exact", "period", "tile")} == {
        k: rec.calibration[k] for k in ("chain_exact", "period", "tile")
    }

    def boom(dec):
        raise AssertionError("measured again")

    monkeypatch.setattr(C, "calibrate", boom)
    m = load(tiny_llama)
    assert m.variant == man.default_variant and m.calibration.chain_exact is True


def test_a_recorded_exactness_claim_is_rechecked(tiny_llama, tmp_path, caplog):
    """A record saying chain_exact where this machine's verify is not exact (here: the concat graph
    without its row guard, lone tokens unpadded) is contradicted by the spot check and re-measured."""
    import onnx

    from dejavuu_build import schema as S
    from dejavuu_build.export.passes.row_guard import strip_row_guard
    from dejavuu_build.runtime.decoder import Decoder
    from dejavuu_build.runtime.session import make_session

    raw = tmp_path / "unguarded.onnx"
    onnx.save(strip_row_guard(onnx.load(str(tiny_llama / "decoder_int4.onnx"))), str(raw))
    dec = Decoder(make_session(raw, threads=2), S.read_contract(tiny_llama))
    with dec.padding(False):
        assert C.spot_check(dec) is False
        f = tmp_path / "rt" / f"calibration-{C.calibration_key('forged', 2)}.json"
        f.parent.mkdir()
        f.write_text(json.dumps({"version": C.CALIBRATION_VERSION, "chain_exact": True, "period": 16, "tile": None}))
        with caplog.at_level(logging.WARNING, logger="dejavuu"):
            cal = C.cached_calibration(dec, "forged", 2, tmp_path / "rt")
    assert cal.chain_exact is False and "contradicts" in caplog.text
    assert json.loads(f.read_text())["chain_exact"] is False


def _tile_exhaustive(dec, period, tiles=C.TILES):
    """The tile rule as the search defines it: every rule at every past, the first that held."""
    from dejavuu_build.runtime.tree import aligned_layout, with_root

    toks = C._tokens(dec, 1100)
    parents = with_root([-1, -1, 0, 1, 2])
    paths = {1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 2, 4], 5: [0, 1, 3, 5]}
    lim = C._limit(dec)
    pasts = [b - o for b in (64, 128, 256, 512, 1024) for o in (1, 3, 8) if b + 2 * period + 8 < lim]
    ok = dict.fromkeys(tiles, True)
    for past in pasts:
        kv = dec.new_cache()
        _, _, pres = dec.forward(toks[:past], None, kv)
        kv.commit(pres, past, list(range(past)))
        step = toks[max(pasts) : max(pasts) + 6]
        chains = {}
        for leaf in (5, 4):
            out, _, _ = dec.forward([step[i] for i in paths[leaf]], None, kv)
            chains.update({node: out[d] for d, node in enumerate(paths[leaf])})
        for tile in tiles:
            slot, slot_parents = aligned_layout(parents, period, 2 * period, past=past, tile=tile)
            kept = [i for i, s_ in enumerate(slot) if s_ >= 0]
            out, _, _ = dec.forward([step[i] for i in kept], slot_parents, kv, slots=[slot[i] for i in kept])
            ok[tile] &= all(np.array_equal(out[j], chains[i]) for j, i in enumerate(kept) if i)
        kv.release()
    return next(((True, t) for t in tiles if ok[t]), (False, None))


@pytest.mark.parametrize("variant", ["int4", "int4-static"])
def test_the_tile_search_stops_at_the_first_rule_that_holds(tiny_llama, variant):
    """The search tries the rules in order and stops at the first that holds at every past (the
    cache put back between rules): the same answer as every rule at every past, fewer forwards;
    and with None listed last, it still finds the first rule that holds."""
    dec = load(tiny_llama, variant=variant).decoder
    period = C.calibrate(dec).period
    assert period is not None
    for tiles in (C.TILES, (16, 32, None), (None,)):
        assert C._tile(dec, period, tiles) == _tile_exhaustive(dec, period, tiles), tiles
