"""`dejavuu-build serve --ray --replicas 2` on a local Ray instance: both replicas serve, a session
(the x-session-id header) always lands on the same replica, and answers equal `Model.generate`.
Ray start-up on this 2-core machine: ~10 s (marker `ray`; CI runs it)."""

import itertools
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("ray")

from dejavuu_build.runtime import load  # noqa: E402
from dejavuu_build.serve.bench import start_server  # noqa: E402
from dejavuu_build.serve.ray_app import REPLICA_HEADER  # noqa: E402

NAME, VARIANT = "tiny-llama", "int4-static"  # the default: the build writes its batched graph


@pytest.mark.ray
def test_two_replicas_with_session_affinity(tiny_llama, tmp_path):
    model = load(tiny_llama, variant=VARIANT)
    proc, url = start_server(
        NAME, "--variant", VARIANT, "--ray", "--replicas", "2", "--method", "pld", log_path=str(tmp_path / "ray.log")
    )
    try:
        # The proxy learns the replica set asynchronously after the deployment is up: affinity is
        # promised while the set is unchanged, so traffic starts once the proxy routes to both.
        known, deadline = set(), time.monotonic() + 120
        for i in itertools.count():
            known.add(httpx.get(url + "/health", headers={"x-session-id": f"warm-{i}"}).headers[REPLICA_HEADER])
            if len(known) == 2:
                break
            assert time.monotonic() < deadline, f"after {i + 1} requests the proxy routes to {known} only"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        seen: dict[str, set[str]] = {}
        for session in [f"user-{i}" for i in range(8)] * 2:
            raw = client.chat.completions.with_raw_response.create(
                model=NAME,
                messages=[{"role": "user", "content": f"the cat sat on the mat {session}"}],
                max_tokens=12,
                temperature=0,
                extra_headers={"x-session-id": session},
            )
            seen.setdefault(session, set()).add(raw.headers[REPLICA_HEADER])
            ref = model.generate([{"role": "user", "content": f"the cat sat on the mat {session}"}], max_new_tokens=12)
            assert raw.parse().choices[0].message.content == ref.text
        assert all(len(r) == 1 for r in seen.values()), seen  # affinity: one replica per session
        assert len(set().union(*seen.values())) == 2  # and both replicas take sessions
    finally:
        proc.terminate()
        proc.wait(60)
