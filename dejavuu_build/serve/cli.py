"""`dejavuu-build serve` and `dejavuu-build bench-serve`.

Only click is imported here: FastAPI, uvicorn and Ray are optional extras (`[serve]`,
`[cluster]`), imported when a command runs, with a one-line message when missing.
"""

from __future__ import annotations

import click

from .. import schema as S
from ..errors import DejavuuError
from ..log import logger
from ..runtime.cli import friendly
from .guard import DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT
from .server import ServeConfig, build_app, need

__all__ = ["ServeConfig", "build_app", "need", "serve", "bench_serve", "listen_socket"]


@click.command()
@click.argument("name")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--method", default="auto", show_default=True, help="Default drafting method (requests may override).")
@click.option("--tree", is_flag=True, help="Verify draft trees by default (requests may override).")
@click.option("--variant", default=None, help="Variant to serve [default: the manifest's default].")
@click.option(
    "--threads", default=None, type=int, help=f"ORT threads, 1 to the CPU count [default: {S.DEFAULT_THREADS}]."
)
@click.option(
    "--max-batch", default=S.DEFAULT_MAX_BATCH, show_default=True, type=int, help="Requests decoded together."
)
@click.option(
    "--max-queue",
    default=S.DEFAULT_MAX_QUEUE,
    show_default=True,
    type=int,
    help="Requests waiting beyond those; more get 429.",
)
@click.option("--no-batch", is_flag=True, help="One request at a time (no batched graph).")
@click.option("--no-memory", is_flag=True, help="No cross-request drafter memory.")
@click.option(
    "--memory-tokens",
    default=S.DEFAULT_MEMORY_TOKENS,
    show_default=True,
    type=int,
    help="Drafter memory bound per namespace.",
)
@click.option("--memory-key", default=None, help="Drafter memory namespace [default: the served name].")
@click.option("--datastore", default=None, help="Datastore name for rest / sam_decoding / asam.")
@click.option("--served-name", default=None, help="Model name in the API [default: NAME's folder name].")
@click.option(
    "--header-timeout",
    default=DEFAULT_HEADER_TIMEOUT,
    show_default=True,
    type=float,
    help="Seconds a request's line and headers may take; then the connection is closed.",
)
@click.option(
    "--body-timeout",
    default=DEFAULT_BODY_TIMEOUT,
    show_default=True,
    type=float,
    help="Seconds a request's body may take (408).",
)
@click.option("--ray", "use_ray", is_flag=True, help="Serve through Ray Serve (pip install 'dejavuu-build[cluster]').")
@click.option("--replicas", default=2, show_default=True, type=int, help="With --ray: runtime replicas.")
@friendly
def serve(
    name,
    host,
    port,
    method,
    tree,
    variant,
    threads,
    max_batch,
    max_queue,
    no_batch,
    no_memory,
    memory_tokens,
    memory_key,
    datastore,
    served_name,
    header_timeout,
    body_timeout,
    use_ray,
    replicas,
):
    """Serve NAME over an OpenAI-compatible HTTP API (FastAPI + uvicorn), with a chat page at /."""
    cfg = ServeConfig(
        name=name,
        variant=variant,
        threads=threads,
        method=method,
        tree=tree,
        max_batch=max_batch,
        max_queue=max_queue,
        batch=not no_batch,
        memory=not no_memory,
        memory_tokens=memory_tokens,
        memory_key=memory_key,
        datastore=datastore,
        served_name=served_name,
        header_timeout=header_timeout,
        body_timeout=body_timeout,
    )
    if not 0 < port < 65536:
        raise DejavuuError(f"--port must be in 1..65535, got {port}")
    cfg.validate()
    if use_ray:
        if replicas < 1:
            raise DejavuuError(f"--replicas must be >= 1, got {replicas}")
        from .ray_app import run_ray

        run_ray(cfg, host=host, port=port, replicas=replicas)
        return
    uvicorn = need("uvicorn", "serve")
    from .guard import guarded_h11

    sock = listen_socket(host, port)  # before the model loads: a taken port fails at once
    try:
        app, sched = build_app(cfg)
        logger.info(
            "serving %s on http://%s:%d/v1 (%s, method %s%s)",
            name,
            host,
            port,
            f"batched, up to {sched.max_batch} requests per forward" if sched.batched else "one request at a time",
            method,
            ", tree" if tree else "",
        )
        try:
            config = uvicorn.Config(
                app,
                log_level="warning",
                timeout_graceful_shutdown=5,
                http=guarded_h11(cfg.header_timeout),  # h11 (not httptools): headers bounded in time and size
            )
            uvicorn.Server(config).run(sockets=[sock])
        finally:
            sched.close()
    finally:
        sock.close()


def listen_socket(host: str, port: int):
    """A socket bound to (host, port), so "serving ... on ..." is printed only once it is ours."""
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as e:
        raise DejavuuError(f"--host {host!r} does not resolve ({e}): pass an address such as 127.0.0.1") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no owner
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise DejavuuError(
            f"cannot listen on {host}:{port} ({e.strerror or e}): another process holds the port or "
            f"the address is not this machine's; pass another --port or --host"
        ) from None
    return sock


@click.command("bench-serve")
@click.option("--url", default=None, help="A running server's base URL (http://host:port); else NAME is started.")
@click.option("--model", "name", default="smollm2-135m", show_default=True, help="Build to serve (without --url).")
@click.option("--concurrency", default="1,2,4,8", show_default=True, help="Client counts to sweep.")
@click.option(
    "--methods",
    default="baseline,suffix_decoding",
    show_default=True,
    help="Methods to compare (baseline = plain decoding).",
)
@click.option("--requests", "n_requests", default=16, show_default=True, type=int, help="Requests per point.")
@click.option("--max-tokens", default=S.DEFAULT_MAX_NEW_TOKENS, show_default=True, type=int)
@click.option(
    "--data", default=None, type=click.Path(), help="Spec-Bench question.jsonl [default: the workspace copy]."
)
@click.option("--multi-turn", is_flag=True, help="Also measure MT-Bench second turns with and without drafter memory.")
@click.option("--out", default=None, type=click.Path(), help="Write the rows as JSON here.")
@friendly
def bench_serve(url, name, concurrency, methods, n_requests, max_tokens, data, multi_turn, out):
    """Throughput, latency and time to first token against concurrency, ours vs plain decoding."""
    from .bench import run_bench

    run_bench(
        url=url,
        name=name,
        concurrency=[int(c) for c in concurrency.split(",") if c.strip()],
        methods=[m.strip() for m in methods.split(",") if m.strip()],
        n_requests=n_requests,
        max_tokens=max_tokens,
        data=data,
        multi_turn=multi_turn,
        out=out,
    )
