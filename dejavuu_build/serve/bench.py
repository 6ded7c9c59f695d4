"""`dejavuu-build bench-serve`: the server under closed-loop load, as its clients see it.

Each point (method x concurrency) sends the same Spec-Bench prompts, ``c`` clients at a time,
each client sending its next request as soon as the last one finished, streaming (to time the
first token). Reported per point: aggregate completion tok/s over the wall time, p50/p95
latency, p50/p95 time to first token, and whether every response's text equals the same
prompt's text at concurrency 1 (greedy: batching must not change a token). Each point uses its
own drafter-memory namespace, so no point drafts from another's answers.

``--multi-turn``: MT-Bench conversations; turn 1 is served, then turn 2 (with turn 1's answer
in the prompt) is timed with the drafter memory of everything served so far, and with an
empty memory; then the same second turns are asked again (repeated traffic).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DejavuuError
from ..log import logger
from .server import need

SPEC_BENCH = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "spec_bench" / "question.jsonl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 180.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise DejavuuError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise DejavuuError(f"the server at {url} did not become healthy in {timeout:.0f} s")


def start_server(
    name: str, *extra: str, port: int | None = None, env: dict | None = None, log_path: str | None = None
) -> tuple[subprocess.Popen, str]:
    """``dejavuu-build serve NAME`` in a subprocess; returns (process, base URL) once healthy."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "dejavuu_build.build.cli", "serve", name, "--port", str(port), *extra]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
    except BaseException:
        proc.kill()
        raise
    return proc, url


def _prompts(data: str | None, n: int) -> list[str]:
    path = Path(data) if data else SPEC_BENCH
    if not path.is_file():
        raise DejavuuError(f"no Spec-Bench questions at {path}: pass --data PATH to question.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    step = max(1, len(rows) // n)
    return [r["turns"][0] for r in rows[::step]][:n]


def _one(client, model: str, messages, method: str, max_tokens: int, key: str) -> dict:
    t0 = time.perf_counter()
    ttft, parts, usage, steps = None, [], None, 0
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"method": method, "memory_key": key},
    )
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
            steps = (ch.model_extra or {}).get("dejavuu", {}).get("steps", 0)
        if ch.choices and ch.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(ch.choices[0].delta.content)
    dt = time.perf_counter() - t0
    return {
        "text": "".join(parts),
        "latency": dt,
        "ttft": ttft if ttft is not None else dt,
        "tokens": usage.completion_tokens if usage else 0,
        "steps": steps,
    }


def load_point(client, model: str, prompts: list[str], method: str, c: int, max_tokens: int, key: str) -> dict:
    """``c`` closed-loop clients over ``prompts``; the aggregate and per-request figures."""
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as ex:
        res = list(ex.map(lambda m: _one(client, model, m, method, max_tokens, key), msgs))
    wall = time.perf_counter() - t0
    lat = np.array([r["latency"] for r in res])
    ttft = np.array([r["ttft"] for r in res])
    toks = sum(r["tokens"] for r in res)
    return {
        "method": method,
        "concurrency": c,
        "requests": len(res),
        "tokens": toks,
        "wall_s": round(wall, 3),
        "tok_s": round(toks / wall, 1),
        "latency_p50": round(float(np.percentile(lat, 50)), 3),
        "latency_p95": round(float(np.percentile(lat, 95)), 3),
        "ttft_p50": round(float(np.percentile(ttft, 50)), 4),
        "ttft_p95": round(float(np.percentile(ttft, 95)), 4),
        "texts": [r["text"] for r in res],
    }


def second_turns(client, model: str, data: str | None, n: int, method: str, max_tokens: int) -> dict:
    """MT-Bench second turns (turn 1's answer in the prompt), interleaved per conversation: plain
    decoding, ``method`` with an empty memory, ``method`` with the memory of everything served so
    far, and the same request once more (repeated traffic)."""
    path = Path(data) if data else SPEC_BENCH
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    conv = [r for r in rows if len(r.get("turns", [])) >= 2][:n]
    if not conv:
        raise DejavuuError(f"{path} has no two-turn (MT-Bench) questions")
    shared = "bench-mt-shared"
    labels = ("baseline", "without_memory", "with_memory", "repeated_with_memory")
    out: dict[str, Any] = {k: {"tokens": 0, "seconds": 0.0, "steps": 0, "texts": []} for k in labels}  # the JSON report
    for i, r in enumerate(conv):
        u1, u2 = r["turns"][0], r["turns"][1]
        a1 = _one(client, model, [{"role": "user", "content": u1}], method, max_tokens, shared)["text"]
        msgs = [{"role": "user", "content": u1}, {"role": "assistant", "content": a1}, {"role": "user", "content": u2}]
        for label, key, m in (
            ("baseline", f"bench-mt-base-{i}", "baseline"),
            ("without_memory", f"bench-mt-none-{i}", method),
            ("with_memory", shared, method),
            ("repeated_with_memory", shared, method),
        ):
            x = _one(client, model, msgs, m, max_tokens, key)
            out[label]["tokens"] += x["tokens"]
            out[label]["seconds"] += x["latency"]
            out[label]["steps"] += x["steps"]
            out[label]["texts"].append(x["text"])
    for label in labels:
        o = out[label]
        o["seconds"] = round(o["seconds"], 3)
        o["tok_s"] = round(o["tokens"] / o["seconds"], 1) if o["seconds"] else 0.0
        o["tokens_per_step"] = round(o["tokens"] / o["steps"], 2) if o["steps"] else 0.0  # load-independent
    base = out["baseline"]["tok_s"] or 1.0
    for label in labels[1:]:
        out[label]["speedup"] = round(out[label]["tok_s"] / base, 3)
        out[label]["identical"] = out[label]["texts"] == out["baseline"]["texts"]
    without = out["without_memory"]["speedup"] or 1.0
    out["memory_gain"] = round(out["with_memory"]["speedup"] / without, 3)
    out["repeated_memory_gain"] = round(out["repeated_with_memory"]["speedup"] / without, 3)
    out["conversations"] = len(conv)
    return out


def run_bench(*, url, name, concurrency, methods, n_requests, max_tokens, data, multi_turn: bool, out) -> list[dict]:
    openai = need("openai", "serve")
    proc = None
    if url is None:
        proc, url = start_server(name, "--max-batch", str(max(concurrency)), "--max-queue", "64")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        prompts = _prompts(data, n_requests)
        rows = []
        for method in methods:
            ref = None
            for c in concurrency:
                row = load_point(client, model, prompts, method, c, max_tokens, f"bench-{method}-{c}")
                texts = row.pop("texts")
                ref = ref if ref is not None else texts
                row["identical_to_c1"] = texts == ref
                rows.append(row)
                logger.info(
                    "%-16s c=%d  %7.1f tok/s  latency p50 %.2f p95 %.2f s  TTFT p50 %.3f p95 %.3f s  %s",
                    method,
                    c,
                    row["tok_s"],
                    row["latency_p50"],
                    row["latency_p95"],
                    row["ttft_p50"],
                    row["ttft_p95"],
                    "identical" if row["identical_to_c1"] else "DIFFERENT",
                )
        for method in methods:
            mine = [r for r in rows if r["method"] == method]
            one = mine[0]
            for r in mine:
                r["x_c1_tok_s"] = round(r["tok_s"] / one["tok_s"], 2) if one["tok_s"] else 0.0
                r["x_c1_ttft_p95"] = round(r["ttft_p95"] / one["ttft_p95"], 2) if one["ttft_p95"] else 0.0
        _table(rows)
        result: dict[str, Any] = {"points": rows}
        if multi_turn:
            method = next((m for m in methods if m != "baseline"), "suffix_decoding")
            mt = second_turns(client, model, data, n_requests, method, max_tokens)
            for k in ("baseline", "without_memory", "with_memory", "repeated_with_memory"):
                mt[k].pop("texts")
            result["multi_turn"] = mt
            print(json.dumps({"multi_turn": mt}, indent=2))
        if out:
            Path(out).write_text(json.dumps(result, indent=2))
        return rows
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)


def _table(rows: list[dict]) -> None:
    print(
        "| method | clients | tok/s | × 1 client | latency p50 / p95 s | TTFT p50 / p95 s | TTFT p95 × 1 client | identical |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['concurrency']} | {r['tok_s']} | {r['x_c1_tok_s']} | {r['latency_p50']} / "
            f"{r['latency_p95']} | {r['ttft_p50']} / {r['ttft_p95']} | {r['x_c1_ttft_p95']} | "
            f"{'yes' if r['identical_to_c1'] else 'NO'} |"
        )
