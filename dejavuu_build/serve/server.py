"""What a server (or one Ray replica) needs to build itself: its settings (`ServeConfig`), the model,
scheduler and FastAPI app built from them (`build_app`), and `need`, which imports an optional
extra or says which one to install.

`serve.cli` (the commands), `serve.ray_app` (a replica) and `serve.bench` (the client) import
from here, and the commands import those two lazily, so no module of `serve` imports another
that imports it back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from .. import schema as S
from ..errors import DejavuuError
from .guard import DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT

if TYPE_CHECKING:
    from ..runtime.settings import DecodeSettings


@dataclass
class ServeConfig:
    """Everything a server (or one Ray replica) needs to build itself."""

    name: str
    variant: str | None = None
    threads: int | None = None
    method: str = "auto"
    tree: bool = False
    max_batch: int = S.DEFAULT_MAX_BATCH
    max_queue: int = S.DEFAULT_MAX_QUEUE
    batch: bool = True
    memory: bool = True
    memory_tokens: int = S.DEFAULT_MEMORY_TOKENS
    memory_key: str | None = None
    datastore: str | None = None
    served_name: str | None = None
    width: int = S.DEFAULT_TREE_WIDTH
    max_depth: int = S.DEFAULT_MAX_DEPTH
    max_nodes: int | None = None
    header_timeout: float = DEFAULT_HEADER_TIMEOUT  # seconds for a request's line and headers (serve.guard)
    body_timeout: float = DEFAULT_BODY_TIMEOUT  # seconds for its whole body

    def to_json(self) -> dict:
        return asdict(self)

    def decode_settings(self) -> DecodeSettings:
        """The settings a request decodes with where its body names none (checked: one line each)."""
        from ..runtime.settings import DecodeSettings

        return DecodeSettings(
            method=self.method, tree=self.tree, width=self.width, max_depth=self.max_depth, max_nodes=self.max_nodes
        )

    def validate(self) -> "ServeConfig":
        """Refuse bounds that would fail later with a traceback (or serve nothing), one line each."""

        def integer(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        for flag, v, lo in (
            ("--max-batch", self.max_batch, 1),
            ("--max-queue", self.max_queue, 0),
            ("--memory-tokens", self.memory_tokens, 1),
        ):
            if not integer(v) or v < lo:
                raise DejavuuError(
                    f"{flag} must be an integer >= {lo}, got {v!r}"
                    + ("; pass --no-memory for no drafter memory" if flag == "--memory-tokens" else "")
                )
        for flag, t in (("--header-timeout", self.header_timeout), ("--body-timeout", self.body_timeout)):
            if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 < t < float("inf"):
                raise DejavuuError(f"{flag} must be a number of seconds > 0, got {t!r}")
        # an empty name would silently mean the default (the folder's name, the served name)
        for flag, name in (("--served-name", self.served_name), ("--memory-key", self.memory_key)):
            if name is not None and not name.strip():
                raise DejavuuError(f"{flag} is empty: give a name, or leave the option out for the default")
        return self


def need(module: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DejavuuError(f"this needs {module}: pip install 'dejavuu-build[{extra}]'") from None


def build_app(cfg: ServeConfig):
    """(app, scheduler) for ``cfg``: load the model, start the scheduler, make the FastAPI app.

    Serves ``cfg.variant``, else the manifest's default: what `generate` and ``load()`` decode, so
    one entry gives one answer. Batching runs the entry's batched graph only when it was made
    from that variant (serve.batch.open_batch); otherwise one request per forward, with one line
    saying why and which ``--variant`` batches."""
    need("fastapi", "serve")
    from ..runtime.drafters import METHODS
    from ..runtime.model import load, load_datastore
    from .app import create_app
    from .memory import Memory
    from .scheduler import Scheduler

    cfg.validate()
    if cfg.method not in METHODS:
        raise DejavuuError(f"unknown method {cfg.method!r}; choose one of: {', '.join(METHODS)}")
    defaults = cfg.decode_settings()
    model = load(cfg.name, variant=cfg.variant, threads=cfg.threads)
    _ = model.calibration  # measured (or read from its cache) now, not inside the first request
    memory = Memory(max_tokens=cfg.memory_tokens) if cfg.memory else None
    ds = load_datastore(cfg.datastore) if cfg.datastore else None
    sched = Scheduler(
        model,
        max_batch=cfg.max_batch,
        max_queue=cfg.max_queue,
        batch=cfg.batch,
        memory=memory,
        datastore=ds,
    )
    served = cfg.served_name or model.folder.name
    app = create_app(
        model,
        sched,
        served_name=served,
        defaults=defaults,
        memory_key=cfg.memory_key,
        body_timeout=cfg.body_timeout,
    )
    return app, sched
