"""Scale-out on Ray Serve: one runtime (model, scheduler, drafter memory) per replica, behind Ray
Serve's HTTP proxy, with session affinity so a conversation keeps hitting the replica whose KV
slots and drafter memory are warm.

Affinity is Ray Serve's consistent-hash request router over the ``x-session-id`` header (Ray's
``RAY_SERVE_SESSION_ID_HEADER_KEY``): the same session always lands on the same replica while the
replica set is unchanged; requests without the header spread evenly. Right after start-up the
proxy may still be learning the set (seconds), and a session can move once then. Every response carries
``x-dejavuu-replica`` so clients (and the tests) can see where it ran.

On a multi-node cluster: ``ray start --head`` on one machine, ``ray start --address HEAD:6379``
on the others, then ``RAY_ADDRESS=auto dejavuu-build serve NAME --ray --replicas N`` on the head;
each machine needs the build in its cache (copy the cache entry, or a shared ``DEJAVUU_CACHE``).
"""

from __future__ import annotations

import os
import signal
import threading

from ..errors import DejavuuError
from ..log import logger
from .server import ServeConfig, build_app, need

REPLICA_HEADER = "x-dejavuu-replica"
ROUTER = "ray.serve.experimental.consistent_hash_router:ConsistentHashRouter"


def deployment(cfg: ServeConfig, replicas: int):
    """The bound Ray Serve application for ``cfg`` with ``replicas`` replicas."""
    need("ray", "cluster")
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    @serve.ingress()
    class DejavuuReplica:
        def __init__(self, cfg_json: dict):
            self._asgi, self._scheduler = build_app(ServeConfig(**cfg_json))
            rid = serve.get_replica_context().replica_id.unique_id

            @self._asgi.middleware("http")
            async def tag(request, call_next):
                response = await call_next(request)
                response.headers[REPLICA_HEADER] = rid
                return response

        def __serve_build_asgi_app__(self):
            return self._asgi

    if replicas < 1:
        raise DejavuuError(f"--replicas must be >= 1, got {replicas}")
    dep = serve.deployment(
        DejavuuReplica,
        name="dejavuu",
        num_replicas=replicas,
        # the scheduler queues and answers 429 itself; Ray only needs to let that many through
        max_ongoing_requests=cfg.max_batch + cfg.max_queue + 1,
        # threads are onnxruntime's (cfg.threads); a CPU reservation would only block small machines
        ray_actor_options={"num_cpus": 0},
        # ray declares request_router_class as Union[str, Callable], which its pydantic model hides from mypy
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER,  # type: ignore[arg-type]
            request_router_kwargs={"num_fallback_replicas": 0},
        ),
    )
    # ray annotates deployment() as the decorator form only; given the class it returns the Deployment
    return dep.bind(cfg.to_json())  # type: ignore[attr-defined]


def run_ray(cfg: ServeConfig, *, host: str, port: int, replicas: int) -> None:
    """Start (or join, with RAY_ADDRESS) a Ray instance, deploy, and serve until SIGINT/SIGTERM."""
    ray = need("ray", "cluster")
    from ray import serve

    ray.init(
        address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False, configure_logging=False
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(deployment(cfg, replicas), name="dejavuu", route_prefix="/")
        logger.info(
            "serving %s through Ray Serve on http://%s:%d/v1 (%d replicas, session affinity on the "
            "x-session-id header)",
            cfg.name,
            host,
            port,
            replicas,
        )
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
