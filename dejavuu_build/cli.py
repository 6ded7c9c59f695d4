"""`dejavuu-build`: the one command group. It registers the build's commands (build.cli), the
runtime's `generate` (runtime.cli) and, when listed or used, the bench's and the server's (their
modules import optional extras); an import failure is loud, never a dropped command."""

from __future__ import annotations

if __name__ == "__main__":  # pragma: no cover - `python -m dejavuu_build.cli`
    import importlib as _importlib

    _importlib.import_module("dejavuu_build.cli").main()
    raise SystemExit(0)

import importlib

import click

from . import __version__
from .build.cli import COMMANDS
from .log import setup_logging
from .runtime.cli import generate


class _Group(click.Group):
    lazy = {
        "bench": "dejavuu_build.bench.cli:bench",
        "serve": "dejavuu_build.serve.cli:serve",
        "bench-serve": "dejavuu_build.serve.cli:bench_serve",
    }

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx, name):
        if name in self.lazy and name not in self.commands:
            module, attr = self.lazy[name].split(":")
            self.add_command(getattr(importlib.import_module(module), attr), name)
        return super().get_command(ctx, name)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="dejavuu-build")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging (a line per quantized tensor).")
def main(verbose: bool) -> None:
    """Build tree-capable ONNX decoders for speculative decoding, and run them."""
    setup_logging(verbose)


for _cmd in (*COMMANDS, generate):
    main.add_command(_cmd)
