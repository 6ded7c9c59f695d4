"""Runtime-facing commands: generate, datastore, bench."""

from __future__ import annotations

import json
import sys

import click

from ..errors import GenerationError
from .cli import _friendly, main


@main.command()
@click.argument("name")
@click.argument("prompt", required=False)
@click.option("--chat", "chat", default=None, help="Send this text as a user message through the chat template.")
@click.option("--method", default="baseline", show_default=True, help="Drafting method (see docs/methods.md).")
@click.option("--tree", is_flag=True, help="Verify a tree of drafts instead of a chain.")
@click.option("--width", default=2, show_default=True, help="Tree width (children per node).")
@click.option("--max-nodes", default=None, type=int, help="Draft nodes per step [chain: 8, tree: 16].")
@click.option("--max-depth", default=8, show_default=True, help="Longest draft path per step.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--variant", default=None, help="fp32 | int8 | int4 [default: the manifest's default].")
@click.option("--datastore", default=None, help="Datastore name for rest / sam_decoding / asam.")
@click.option("--threads", default=2, show_default=True)
@click.option("--image", "images", multiple=True, help="Image file for a VLM build (repeatable).")
@click.option("--draft-model", default=None, help="For --method draft_model: NAME[:VARIANT] of the drafting build.")
@click.option("--stream", is_flag=True, help="Print text as it is generated.")
@click.option("--json", "as_json", is_flag=True, help="Print the result and stats as JSON.")
@_friendly
def generate(name, prompt, chat, method, tree, width, max_nodes, max_depth, max_new_tokens, temperature, top_p,
             top_k, seed, stop, variant, datastore, threads, images, draft_model, stream, as_json):
    """Generate from a built decoder with speculative decoding."""
    from ..runtime import load

    if chat is None and prompt is None:
        raise GenerationError("give a PROMPT or --chat TEXT")
    model = load(name, variant=variant, threads=threads)
    inp = [{"role": "user", "content": chat}] if chat is not None else prompt
    kw = dict(method=method, tree=tree, width=width, max_nodes=max_nodes, max_depth=max_depth,
              max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
              stop=stop, datastore=datastore, images=list(images) or None)
    if draft_model:
        kw["draft_model"] = draft_model
    if stream and not as_json:
        for piece in model.stream(inp, **kw):
            click.echo(piece, nl=False)
            sys.stdout.flush()
        click.echo()
        return
    res = model.generate(inp, **kw)
    if as_json:
        d = res.to_json()
        d.update(model=str(model.folder), variant=model.variant)
        click.echo(json.dumps(d, indent=2))
        return
    click.echo(res.text)
    s = res.stats
    click.echo(f"[{model.variant} · {res.method}{' tree' if res.tree else ''} · {s.tokens} tokens in {s.steps} steps · "
               f"{s.tokens_per_step:.2f} tok/step · accepted {s.accepted}/{s.drafted} · decode {s.decode_tok_s:.1f} tok/s · "
               f"stop: {res.stop_reason}]", err=True)


@main.command()
@click.option("--from", "src", required=True, type=click.Path(), help="A .jsonl (fields turns/text/prompt) or .txt file.")
@click.option("--tokenizer", "tok", required=True, help="A built model's cache name (or folder) whose tokenizer to use.")
@click.option("--name", required=True, help="Cache name for the datastore.")
@click.option("--force", is_flag=True)
@_friendly
def datastore(src, tok, name, force):
    """Build a token datastore (for rest, sam_decoding, asam) into the cache."""
    from .datastore import build_datastore

    out = build_datastore(src, tok, name, force=force)
    click.echo(f"built: {out}")


try:  # the bench command lives with the benchmark code
    from ..bench.cli import bench  # noqa: E402

    main.add_command(bench)
except ImportError:  # pragma: no cover
    pass
