"""runtime.settings.DecodeSettings: one validated value per request, built once at each entry point.

Each bad value is one line naming the setting (SettingsError, a GenerationError: exit 2 on the CLI,
HTTP 400 naming the field on the server); the same request given to the CLI, the Python API and
the server builds equal settings; the type's defaults are `Model.generate`'s."""

from __future__ import annotations

import inspect
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dejavuu_build import schema as S
from dejavuu_build.cli import main
from dejavuu_build.errors import GenerationError
from dejavuu_build.runtime import model as model_module
from dejavuu_build.runtime.drafters import METHODS
from dejavuu_build.runtime.drafters.base import Drafter
from dejavuu_build.runtime.model import Model
from dejavuu_build.runtime.settings import DecodeSettings, SettingsError

BAD = [
    ({"temperature": float("nan")}, "temperature", "temperature must be a finite number >= 0 (0 = greedy), got nan"),
    ({"temperature": float("inf")}, "temperature", "temperature must be a finite number >= 0 (0 = greedy), got inf"),
    ({"temperature": -0.5}, "temperature", "temperature must be a finite number >= 0 (0 = greedy), got -0.5"),
    ({"temperature": "0.5"}, "temperature", "temperature must be a finite number >= 0 (0 = greedy), got '0.5'"),
    ({"top_p": 0.0}, "top_p", "top_p must be in (0, 1], got 0.0"),
    ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5"),
    ({"top_p": float("nan")}, "top_p", "top_p must be in (0, 1], got nan"),
    ({"top_k": -1}, "top_k", "top_k must be an integer >= 0 (0 = off), got -1"),
    ({"top_k": 2.0}, "top_k", "top_k must be an integer >= 0 (0 = off), got 2.0"),
    ({"seed": -1}, "seed", "seed must be an integer >= 0, got -1"),
    ({"seed": True}, "seed", "seed must be an integer >= 0, got True"),
    ({"width": 0}, "width", "width must be an integer >= 1, got 0"),
    ({"max_depth": 0}, "max_depth", "max_depth must be an integer >= 1, got 0"),
    ({"max_new_tokens": 0}, "max_new_tokens", "max_new_tokens must be an integer >= 1, got 0"),
    ({"max_new_tokens": None}, "max_new_tokens", "max_new_tokens must be an integer >= 1, got None"),
    ({"max_nodes": 0}, "max_nodes", "max_nodes must be an integer >= 1, got 0"),
    ({"stop": [""]}, "stop", "stop strings must be non-empty text, got ''"),
    ({"stop": [5]}, "stop", "stop strings must be non-empty text, got 5"),
    ({"stop": 5}, "stop", "stop must be a string or a list of strings, got 5"),
    ({"stop": b"ab"}, "stop", "stop must be a string or a list of strings, got b'ab'"),
    ({"method": "nope"}, "method", f"unknown method 'nope'; choose one of: {', '.join(METHODS)}, draft_model"),
]


@pytest.mark.parametrize("kw, field, message", BAD)
def test_each_bad_value_is_one_line_naming_it(kw, field, message):
    with pytest.raises(SettingsError) as e:
        DecodeSettings(**kw)
    assert str(e.value) == message and "\n" not in message
    assert e.value.field == field and isinstance(e.value, GenerationError)
    with pytest.raises(SettingsError, match=field):  # a copy is checked too
        replace(DecodeSettings(), **kw)


def test_good_values_are_kept_and_stop_is_a_tuple():
    s = DecodeSettings(
        method="pld",
        tree=True,
        temperature=np.float32(0.5),
        top_k=np.int64(3),
        seed=2**62,
        stop="x",
        max_nodes=4,
    )
    assert s.stop == ("x",) and s.tree is True and s.method_name == "pld"
    assert s.sampler.temperature == np.float32(0.5) and s.sampler.top_k == 3 and s.sampler.seed == 2**62
    assert DecodeSettings(stop=None).stop == () == DecodeSettings(stop=[]).stop
    assert DecodeSettings(stop=["a", "b"]) == DecodeSettings(stop=("a", "b"))
    assert hash(DecodeSettings(stop=["a"])) == hash(DecodeSettings(stop=("a",)))
    assert DecodeSettings(method="draft_model").method == "draft_model"
    d = Drafter()
    assert DecodeSettings(method=d).method is d and DecodeSettings(method=d).method_name == d.name
    with pytest.raises(AttributeError):
        s.temperature = 1.0  # type: ignore[misc]


def test_defaults_are_generates():
    """The type's defaults are `Model.generate`'s keyword defaults, and it takes each of them."""
    params = inspect.signature(Model.generate).parameters
    for f in fields(DecodeSettings):
        assert params[f.name].default == f.default, f.name
    assert DecodeSettings.names() == tuple(f.name for f in fields(DecodeSettings))
    assert DecodeSettings.split({"seed": 1, "datastore": "d"}) == ({"seed": 1}, {"datastore": "d"})


def test_settings_or_keywords_not_both():
    s = DecodeSettings(seed=3)
    assert DecodeSettings.given(s, {}) is s
    assert DecodeSettings.given(s, {"seed": 0, "stop": []}) is s  # the defaults, spelled out
    assert DecodeSettings.given(None, {"seed": 3}) == s
    with pytest.raises(SettingsError, match="not both .*temperature"):
        DecodeSettings.given(s, {"temperature": 0.5})
    with pytest.raises(SettingsError, match="settings must be a DecodeSettings"):
        DecodeSettings.given({"seed": 3}, {})  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- one request, three doors
REQUEST = dict(method="pld", tree=True, max_new_tokens=20, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=("x", "y"))
CLI = [
    "--method", "pld", "--tree", "--max-new-tokens", "20", "--temperature", "0.7",
    "--top-p", "0.9", "--top-k", "5", "--seed", "3", "--stop", "x", "--stop", "y",
]  # fmt: skip


def _cli_settings(monkeypatch, *args) -> tuple[DecodeSettings, dict]:
    """The settings `dejavuu-build generate` passes to the model (its load replaced by a fake)."""
    seen: list = []

    class Fake:
        def generate(self, prompt, settings, **kw):
            seen.append((settings, kw))
            raise GenerationError("seen")  # (one line, exit 2: nothing decoded)

    monkeypatch.setattr(model_module, "load", lambda *a, **k: Fake())
    r = CliRunner().invoke(main, ["generate", "any-build", "hello", *args])
    assert r.exit_code == 2 and r.output.strip() == "error: seen", r.output
    return seen[0]


def _api_settings(monkeypatch, *a, **kw) -> DecodeSettings:
    """The settings `Model.generate` decodes with, given keyword arguments."""
    monkeypatch.setattr(Model, "_generate", lambda self, prompt, s, **_: s)
    m = Model(Path("."), "x", None, None, None)  # type: ignore[arg-type]
    return m.generate("hello", *a, **kw)  # type: ignore[return-value]


def test_cli_api_and_server_build_equal_settings(monkeypatch):
    pytest.importorskip("fastapi")
    from dejavuu_build.serve.app import ChatBody, CompletionBody, request_settings
    from dejavuu_build.serve.server import ServeConfig

    want = DecodeSettings(**REQUEST)  # type: ignore[arg-type]
    cli, rest = _cli_settings(monkeypatch, *CLI, "--datastore", "ds")
    assert cli == want and rest["datastore"] == "ds"
    assert _api_settings(monkeypatch, **REQUEST) == want
    assert _api_settings(monkeypatch, want) == want
    defaults = ServeConfig(name="m").decode_settings()
    assert defaults == DecodeSettings(method="auto")
    body = {
        "model": "m",
        "max_tokens": 20,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "seed": 3,
        "stop": ["x", "y"],
        "method": "pld",
        "tree": True,
    }
    comp = CompletionBody.model_validate({**body, "prompt": "hello"})
    chat = ChatBody.model_validate({**body, "messages": [{"role": "user", "content": "hello"}]})
    for b in (comp, chat):
        assert request_settings(b, defaults, 20, 3) == want
    # and the plain defaults: the CLI's and the API's, the server's over its own method
    assert _cli_settings(monkeypatch)[0] == _api_settings(monkeypatch) == DecodeSettings()
    plain = CompletionBody.model_validate({"model": "m", "prompt": "hello", "temperature": 0})
    assert request_settings(plain, defaults, S.DEFAULT_MAX_NEW_TOKENS, 0) == DecodeSettings(method="auto")


def test_a_bad_setting_is_one_line_on_the_cli_before_loading(monkeypatch):
    monkeypatch.setattr(model_module, "load", lambda *a, **k: pytest.fail("loaded"))
    for args, needle in (
        (["--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
        (["--stop", ""], "stop strings must be non-empty text"),
        (["--max-nodes", "0"], "max_nodes must be an integer >= 1, got 0"),
        (["--method", "nope"], "unknown method 'nope'"),
    ):
        r = CliRunner().invoke(main, ["generate", "any-build", "hello", *args])
        assert r.exit_code == 2, r.output
        assert r.output.strip() == f"error: {r.output.strip()[7:]}" and needle in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1


def test_a_bad_setting_is_a_400_naming_the_field_on_the_server():
    pytest.importorskip("fastapi")
    from dejavuu_build.serve.app import APIError, CompletionBody, request_settings

    ok = {"model": "m", "prompt": "hello"}
    defaults = DecodeSettings(method="auto")
    for field, value in (("top_k", -1), ("temperature", float("nan")), ("stop", [""])):
        body = CompletionBody.model_construct(**{**CompletionBody.model_validate(ok).model_dump(), field: value})
        with pytest.raises(APIError) as e:
            request_settings(body, defaults, 10, 0)
        assert e.value.status == 400 and e.value.param == field, e.value.message
    with pytest.raises(APIError) as e:
        request_settings(CompletionBody.model_validate(ok), defaults, 0, 0)
    assert e.value.param == "max_tokens"
    with pytest.raises(APIError) as e:
        request_settings(CompletionBody.model_validate({**ok, "method": "draft_model"}), defaults, 10, 0)
    assert e.value.param == "method" and e.value.code == "unknown_method"
