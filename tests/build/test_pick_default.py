"""The default variant: the fastest passing one, without flipping on timing noise."""

from dejavuu_build.build.pipeline import _pick_default
from dejavuu_build.schema import Manifest, VariantRecord


def _rec(ms, mb, passed=True, layout="concat"):
    keys = ("n2_p256", "n8_p256", "n2_p1024", "n8_p1024")
    return VariantRecord(file="x", bytes=int(mb * 1e6), passed=passed, kv_layout=layout,
                         timings_ms=dict.fromkeys(keys, ms) if ms else {})


def test_fastest_passing_variant_wins():
    m = Manifest(variants={"int4": _rec(10, 97), "int4-static": _rec(9.5, 99, layout="static"),
                           "int8-static": _rec(6, 152, layout="static"), "fp32": _rec(4, 538, passed=False)})
    assert _pick_default(m) == "int8-static"          # fp32 is faster but failed its gates


def test_a_tie_within_noise_goes_to_the_smaller_precision_then_the_static_layout():
    m = Manifest(variants={"int8-static": _rec(9.8, 152, layout="static"), "int4": _rec(10, 97),
                           "int4-static": _rec(10.5, 99, layout="static")})
    assert _pick_default(m) == "int4-static"


def test_untimed_builds_pick_the_smallest_file():
    m = Manifest(variants={"int4": _rec(None, 97), "int4-static": _rec(None, 99, layout="static")})
    assert _pick_default(m) == "int4"
    assert _pick_default(Manifest(variants={"int4": _rec(5, 97, passed=False)})) is None
