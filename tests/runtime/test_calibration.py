"""Machine-local exactness calibration: measured, cached, validated when read, and obeyed."""

import json
import logging

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
    for bad in ({"version": C.CALIBRATION_VERSION, "chain_exact": True, "period": 0, "tile": None},
                {"version": C.CALIBRATION_VERSION, "chain_exact": "yes", "period": 16, "tile": None},
                {"version": C.CALIBRATION_VERSION, "chain_exact": True, "period": 16, "tile": 40},
                "not json {"):
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
