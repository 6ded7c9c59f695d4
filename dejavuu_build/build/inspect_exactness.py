"""`dejavuu-build inspect --exactness`: why a built decoder is (or is not) lossless on this machine.

Two levels, both measured here: every op signature of the graph cut out and probed for row
invariance (export.exactness: a row alone, among 2..17 rows, beside a pad row), and the whole
decoder's batched = incremental check as the runtime runs it (gates.gate_batched over the build's
own references). The op table names the first op that breaks a lone row; the model line says
whether the graph as built (with its row guard, if any) is exact here.
"""

from __future__ import annotations

from pathlib import Path

from .. import schema as S
from ..errors import CacheError


def exactness_report(target: str, variant: str | None, threads: int) -> tuple[list[str], dict]:
    """(lines to print, JSON record) for a cache name or entry folder and one of its variants."""
    from ..cache import locate, read_checked_manifest
    from ..export.exactness import format_report, probe
    from ..export.fp16_store import load_unpacked
    from ..runtime.session import derive_contract, make_session
    from .gates import gate_batched
    from .references import Reference
    from .runner import Runner

    folder = Path(locate(target))
    if not (folder / S.MANIFEST_FILE).is_file():
        raise CacheError(f"no built entry {target!r}: pass a cache name or an entry folder with a manifest.json")
    manifest = read_checked_manifest(folder)
    if manifest.kind not in S.DECODER_KINDS:
        raise CacheError(
            f"{target} is a {manifest.kind} entry, not a decoder build: pass the cache name of a decoder "
            f"(`dejavuu-build tree-decoder` builds one)"
        )
    v = variant or manifest.default_variant
    if v not in manifest.variants:
        which = f"variant {v!r};" if v is not None else "default variant (none passed its gates): pass --variant;"
        raise CacheError(f"{target} has no {which} it has {', '.join(sorted(manifest.variants)) or 'none'}")
    rec = manifest.variants[v]
    contract = S.variant_contract(S.read_contract(folder), rec)
    _, layout = S.split_variant(v)
    proto = load_unpacked(folder / rec.file)
    rep = probe(proto, layout=layout, heads=contract.num_heads, head_dim=contract.head_dim, threads=threads)
    lines = format_report(rep, f"{target} {v}")
    guard = S.row_guard_info({p.key: p.value for p in proto.metadata_props})
    lines.append(
        f"  row guard in the graph: {guard.get('nodes', 0)} nodes "
        f"({', '.join(guard.get('guarded', [])) or 'none'}), length-invariant as built: "
        f"{guard.get('length_invariant', False)} (measured on "
        f"{guard.get('machine', {}).get('isa', 'an unrecorded machine')})"
        if guard
        else "  row guard in the graph: none (built before the guard, or a static flavour)"
    )
    out = {"entry": str(folder), "variant": v, **rep.to_json(), "graph_row_guard": guard}
    sess = make_session(folder / rec.file, threads=threads)
    derived = derive_contract(sess)
    embed = None
    if contract.primary_input == S.INPUTS_EMBEDS:
        from ..runtime.vision import load_embedder

        embed = load_embedder(folder, threads)
    gate = gate_batched(Runner(sess, contract, embed), Reference.load(folder / S.REFERENCE_FILE))
    lone = "one row" if derived.length_invariant or layout == S.KV_ROWWISE else "two rows (runtime pad)"
    lines.append(
        f"  whole decoder, a lone token as {lone}: batched = incremental "
        f"{gate['total'] - gate['mismatches']}/{gate['total']} argmax, logits max diff "
        f"{gate['logits_maxdiff']:.3g} -> {'EXACT' if gate['passed'] else 'NOT EXACT'} on this machine"
    )
    out["model"] = gate
    return lines, out
