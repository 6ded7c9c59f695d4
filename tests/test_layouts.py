"""One home per KV layout (issue 36): each layout's module (dejavuu_build/layouts/<layout>.py) owns its
registry entry, its cache, its single-request driver and its batched driver; the runtime's Decoder,
the build's gates (build.runner.Runner) and the server (serve.batch) get their driver from the
registry, and no other module writes a layout's feeds."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dejavuu_build import schema as S
from dejavuu_build.layouts import LAYOUTS, BatchDriver, BatchUnavailable, Driver, Layout

ROOT = Path(__file__).resolve().parents[1] / "dejavuu_build"

# The inputs only one layout's graphs take (schema's names for them): fed by that layout's module only.
LAYOUT_INPUTS = ("SLOT_ROWS", "ROW_SLOTS", "KV_WRITE_INDEX", "GQA_POSITIONS", "SEQLENS_K", "QUERY_SEQLENS")
LAYOUT_INPUTS += ("PAD_INDEX", "UNPAD_INDEX")
# ... besides the format (schema), the passes that write those inputs into graphs and the contract's
# derivation from a graph (runtime.session)
MAY_NAME_THEM = ("layouts/", "schema.py", "export/passes/", "runtime/session.py")
# onnxruntime I/O binding: how the in-place layouts feed their graphs (and the genai peer its own)
MAY_BIND = ("layouts/", "bench/genai.py")


def test_every_layout_names_its_drivers_in_its_own_module():
    for name, lay in LAYOUTS.items():
        module = importlib.import_module(f"dejavuu_build.layouts.{name}")
        assert module.LAYOUT is lay and lay.name == name, name
        assert issubclass(lay.driver, Driver) and lay.driver.__module__ == module.__name__, name
        for method in ("new_cache", "forward"):
            assert getattr(lay.driver, method) is not getattr(Driver, method), f"{name}: {method} not defined"
        assert (lay.batch_pass is None) == (lay.batch_driver is None), f"{name}: a batched graph needs both"
        if lay.batch_driver is not None:
            assert issubclass(lay.batch_driver, BatchDriver) and lay.batch_driver.__module__ == module.__name__
            assert lay.batch_driver.forward is not BatchDriver.forward, name
    assert LAYOUTS[S.KV_ROWWISE].driver.one_row and not LAYOUTS[S.KV_STATIC].driver.one_row


def _files(allowed: tuple[str, ...]):
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        if not rel.startswith(allowed):
            yield rel, ast.parse(f.read_text(encoding="utf-8"))


def test_a_layouts_feeds_are_written_in_its_module_only():
    """Feeds written twice is how the three drivers drifted apart: no module outside the layouts (and
    the format, the passes, the contract's derivation) names a layout's own inputs, and none outside
    the layouts binds a graph's I/O."""
    values = {getattr(S, n) for n in LAYOUT_INPUTS}
    found = []
    for rel, tree in _files(MAY_NAME_THEM):
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id in LAYOUT_INPUTS:
                found.append(f"{rel}:{node.lineno} {node.id}")
            elif isinstance(node, ast.Attribute) and node.attr in LAYOUT_INPUTS:
                found.append(f"{rel}:{node.lineno} {node.attr}")
            elif isinstance(node, ast.alias) and node.name in LAYOUT_INPUTS:
                found.append(f"{rel} imports {node.name}")
            elif isinstance(node, ast.Constant) and node.value in values:
                found.append(f"{rel}:{node.lineno} {node.value!r}")
    assert not found, f"a layout's inputs fed outside dejavuu_build/layouts/: {found}"
    bound = [
        f"{rel}:{node.lineno}"
        for rel, tree in _files(MAY_BIND)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in ("io_binding", "run_with_iobinding")
    ]
    assert not bound, f"graph I/O bound outside dejavuu_build/layouts/: {bound}"


# ------------------------------------------------------------- a new layout flows through all three
class _Session:
    """Enough of an InferenceSession for a Decoder to be made (the fake drivers never run it)."""

    def get_inputs(self):
        return [SimpleNamespace(name=S.INPUT_IDS)]

    def get_outputs(self):
        return [SimpleNamespace(name=n) for n in (S.LOGITS, "present.0.key", "present.0.value")]


class _Cache:
    length = 0

    def commit(self, present, n_new, keep):
        self.length += len(keep)

    def truncate(self, length):
        self.length = min(self.length, length)

    def ensure(self, positions):
        pass

    def release(self):
        pass


class _Driver(Driver):
    one_row = True
    calls: list[str] = []

    def new_cache(self):
        _Driver.calls.append("new_cache")
        return _Cache()

    def forward(self, tokens, parents, kv, embeds=None, copy=True, slots=None, last=None):
        _Driver.calls.append(f"forward {len(tokens)}")
        return np.full((len(tokens), 4), 7.0, np.float32), None, None

    def past_feeds(self, past, bias, rows):
        _Driver.calls.append(f"past_feeds {rows}")
        return dict(past), bias, None

    def run(self, names, feeds):  # what the session would give: logits [1, rows, 4] and the present
        rows = feeds[S.INPUT_IDS].shape[1]
        return [np.full((1, rows, 4), 3.0, np.float32)] + [np.zeros((1, 1, rows, 2), np.float32)] * 2


class _Batch(BatchDriver):
    def __init__(self, decoder, path, max_batch, threads):
        self.decoder, self.path, self.max_batch = decoder, path, max_batch

    def forward(self, lo, rows):
        return [(np.zeros((len(r.tokens), 4), np.float32), None) for r in rows]


def test_a_registered_layout_drives_the_decoder_the_gates_and_the_server(monkeypatch):
    from dejavuu_build.build.runner import Runner
    from dejavuu_build.runtime.decoder import Decoder
    from dejavuu_build.serve.batch import batch_decoder

    fake = Layout("fake", rank=len(LAYOUTS), in_place=False, driver=_Driver, batch_driver=_Batch)
    monkeypatch.setitem(LAYOUTS, "fake", fake)
    c = S.Contract(kv_layout="fake", num_layers=1, num_kv_heads=1, head_dim=2, vocab_size=4)
    _Driver.calls.clear()

    dec = Decoder(_Session(), c)  # the runtime
    assert type(dec.driver) is _Driver and dec.rowwise and dec.single_rows == 1
    kv = dec.new_cache()
    logits, _, _ = dec.forward([1, 2], None, kv)
    assert isinstance(kv, _Cache) and (logits == 7.0).all()

    r = Runner(_Session(), c)  # the build's gates
    lg, _, present = r.prefill(np.array([1, 2, 3]))
    assert type(r.dec.driver) is _Driver and lg.shape == (3, 4) and (lg == 3.0).all()
    assert {k: v.shape for k, v in present.items()} == {k: (1, 1, 3, 2) for k in dec.kv_in}

    batch = batch_decoder(dec, Path("batched.onnx"), 2, 1)  # the server
    assert type(batch) is _Batch and batch.decoder is dec
    assert _Driver.calls == ["new_cache", "forward 2", "past_feeds 3"]

    monkeypatch.setitem(LAYOUTS, "fake", Layout("fake", rank=len(LAYOUTS), in_place=False, driver=_Driver))
    with pytest.raises(BatchUnavailable, match="no batched serving for the fake KV layout"):
        batch_decoder(dec, Path("batched.onnx"), 2, 1)


def test_kv_buffers_are_touched_page_by_page():
    """The in-place KV buffers (layouts.base.kv_zeros) are zeros, writable, and cost memory only
    where a context writes: a first token in every layer's kv head of a capacity-8192 buffer
    (SmolLM2-135M's shape) adds 4 KiB pages, not a 2 MiB transparent huge page each."""
    from dejavuu_build.layouts.base import kv_zeros

    def resident() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

    small = kv_zeros((2, 3), np.float32)
    assert small.dtype == np.float32 and not small.any()
    buf = kv_zeros((60, 1, 3, 8192, 64), np.float32)  # 377 MB
    assert buf.shape == (60, 1, 3, 8192, 64) and buf.flags.writeable
    before = resident()
    buf[:, 0, :, 0] = 1.0  # one position of each of the 180 (layer, kv head) regions
    grew = resident() - before
    assert grew < 32 << 20, f"{grew >> 20} MiB resident for 180 touched positions"
    assert buf[:, 0, :, 0].all() and not buf[:, 0, :, 1:].any()
