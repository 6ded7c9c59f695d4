"""The runtime's command (`dejavuu-build generate`) and the error shell every command shares.

Registered into the one `dejavuu-build` group by :mod:`dejavuu_build.cli`; it imports
nothing from the build side (torch-free, like the rest of the runtime).
"""

from __future__ import annotations

import errno
import json
import logging
import sys
from contextlib import closing, contextmanager
from functools import wraps

import click

from .. import schema as S
from ..errors import DejavuuError, GenerationError
from ..log import logger


def friendly(fn):
    """Turn typed errors into one line on stderr and exit code 2; never a traceback."""

    @wraps(fn)
    def inner(*a, **kw):
        try:
            return fn(*a, **kw)
        except DejavuuError as e:
            click.echo(f"error: {_one_line(e)}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted: nothing was written to the cache", err=True)
            sys.exit(130)
        except BrokenPipeError:
            _reader_left()
        except OSError as e:  # the machine's, not the input's: a full disk, a read-only cache, stdout
            click.echo(f"error: {_os_error(e)}", err=True)
            sys.exit(2)
        except (click.exceptions.Exit, click.ClickException, SystemExit):
            raise
        except Exception as e:
            if logger.isEnabledFor(logging.DEBUG):
                raise
            click.echo(
                f"error: unexpected {type(e).__name__}: {_one_line(e)[:300]} (run with -v for details)", err=True
            )
            sys.exit(1)

    return inner


_OS_HINTS = {
    errno.ENOSPC: "free disk space (or point DEJAVUU_CACHE at a disk with room) and run it again",
    errno.EDQUOT: "free space in your quota and run it again",
    errno.EROFS: "the file system is read-only: point DEJAVUU_CACHE (or the output) at a writable folder",
    errno.EACCES: "check its permissions, or point DEJAVUU_CACHE at a folder you can write",
    errno.EPERM: "check its permissions, or point DEJAVUU_CACHE at a folder you can write",
}


def _os_error(e: OSError) -> str:
    """One line for an OSError: what failed, on which file, and what to do."""
    hint = _OS_HINTS.get(e.errno or 0, "check that path and run it again")
    what = e.strerror or type(e).__name__
    return f"{what}: {e.filename}; {hint}" if e.filename else f"{what}; {hint}"


@contextmanager
def _output():
    """Writes to stdout: one that fails (``> /dev/full``) is one line naming the output, and stdout
    is pointed at /dev/null so the interpreter's final flush does not fail again."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as e:
        _stdout_to_devnull()
        raise DejavuuError(
            f"{e.strerror or type(e).__name__}: the output (stdout) could not be written; free space "
            f"where it goes, or send it elsewhere"
        ) from None


def _stdout_to_devnull() -> None:
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _reader_left():
    """The reader of stdout went away (``| head``): stop quietly with the shell's SIGPIPE status,
    pointing stdout at /dev/null so the interpreter's final flush does not complain again."""
    _stdout_to_devnull()
    sys.exit(141)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) if str(e) else type(e).__name__


@click.command()
@click.argument("name")
@click.argument("prompt", required=False)
@click.option("--chat", "chat", default=None, help="Send this text as a user message through the chat template.")
@click.option("--method", default="baseline", show_default=True, help="Drafting method (see docs/methods.md).")
@click.option("--tree", is_flag=True, help="Verify a tree of drafts instead of a chain.")
@click.option(
    "--width", default=S.DEFAULT_TREE_WIDTH, show_default=True, type=int, help="Tree width (children per node, >= 1)."
)
@click.option("--max-nodes", default=None, type=int, help="Draft nodes per step [chain: 8, tree: 16].")
@click.option(
    "--max-depth", default=S.DEFAULT_MAX_DEPTH, show_default=True, type=int, help="Longest draft path per step."
)
@click.option("--max-new-tokens", default=S.DEFAULT_MAX_NEW_TOKENS, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy; finite, >= 0.")
@click.option("--top-p", default=1.0, show_default=True, type=float, help="In (0, 1].")
@click.option("--top-k", default=0, show_default=True, type=int, help=">= 0 (0 = off).")
@click.option("--seed", default=0, show_default=True, type=int, help=">= 0.")
@click.option("--stop", multiple=True, help="Stop string (repeatable, non-empty).")
@click.option("--variant", default=None, help="fp32 | int8 | int4 [default: the manifest's default].")
@click.option("--datastore", default=None, help="Datastore name for rest / sam_decoding / asam.")
@click.option(
    "--threads", default=None, type=int, help=f"ORT threads, 1 to the CPU count [default: {S.DEFAULT_THREADS}]."
)
@click.option("--image", "images", multiple=True, help="Image file for a VLM build (repeatable).")
@click.option("--draft-model", default=None, help="For --method draft_model: NAME[:VARIANT] of the drafting build.")
@click.option("--stream", is_flag=True, help="Print text as it is generated.")
@click.option("--json", "as_json", is_flag=True, help="Print the result and stats as JSON.")
@friendly
def generate(
    name,
    prompt,
    chat,
    method,
    tree,
    width,
    max_nodes,
    max_depth,
    max_new_tokens,
    temperature,
    top_p,
    top_k,
    seed,
    stop,
    variant,
    datastore,
    threads,
    images,
    draft_model,
    stream,
    as_json,
):
    """Generate from a built decoder with speculative decoding.

    NAME is a cache name, or a path (./folder, path/to/decoder_int4.onnx)."""
    from .model import check_text, check_threads, load
    from .settings import DecodeSettings

    if chat is None and prompt is None:
        raise GenerationError("give a PROMPT or --chat TEXT")
    if chat is not None and prompt is not None:
        raise GenerationError("give a PROMPT or --chat TEXT, not both")
    check_text(chat if chat is not None else prompt, "--chat text" if chat is not None else "the prompt")
    settings = DecodeSettings(
        method=method,
        tree=tree,
        width=width,
        max_nodes=max_nodes,
        max_depth=max_depth,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=stop,
    )
    threads = check_threads(threads)
    model = load(name, variant=variant, threads=threads)
    inp = [{"role": "user", "content": chat}] if chat is not None else prompt
    kw: dict = dict(datastore=datastore, images=list(images) or None)
    if draft_model:
        kw["draft_model"] = draft_model
    if stream and not as_json:
        with _output(), closing(model.stream(inp, settings, **kw)) as pieces:  # a reader that leaves stops it at once
            for piece in pieces:
                click.echo(piece, nl=False)
                sys.stdout.flush()
            click.echo()
        return
    res = model.generate(inp, settings, **kw)
    if as_json:
        d = res.to_json()
        d.update(model=str(model.folder), variant=model.variant)
        with _output():
            click.echo(json.dumps(d, indent=2))
        return
    with _output():
        click.echo(res.text)
    s = res.stats
    click.echo(
        f"[{model.variant} · {res.method}{' tree' if res.tree else ''} · {s.tokens} tokens in {s.steps} steps · "
        f"{s.tokens_per_step:.2f} tok/step · accepted {s.accepted}/{s.drafted} · decode {s.decode_tok_s:.1f} tok/s · "
        f"stop: {res.stop_reason}]",
        err=True,
    )
