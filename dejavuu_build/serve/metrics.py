"""/metrics in the Prometheus text format, rendered from the scheduler's counters on each scrape
(prometheus_client's own registry per server, so two apps in one process never clash)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _Collector:
    def __init__(self, scheduler):
        self.s = scheduler

    def collect(self):
        s, m = self.s, self.s.metrics
        req = CounterMetricFamily("dejavuu_requests", "Finished requests by outcome", labels=["status"])
        for k, v in m.requests.items():
            req.add_metric([k], v)
        yield req
        yield CounterMetricFamily("dejavuu_prompt_tokens", "Prompt tokens admitted", value=m.prompt_tokens)
        yield CounterMetricFamily("dejavuu_completion_tokens", "Tokens generated", value=m.completion_tokens)
        yield GaugeMetricFamily(
            "dejavuu_tokens_per_second", "Tokens generated per second over the last 10 s", value=m.tokens_per_s()
        )
        yield GaugeMetricFamily("dejavuu_queue_depth", "Requests waiting for a batch slot", value=s.queue_depth())
        yield GaugeMetricFamily("dejavuu_active_requests", "Requests being decoded", value=s.active_count())
        yield CounterMetricFamily("dejavuu_forwards", "Decoder forwards run", value=m.forwards)
        yield CounterMetricFamily("dejavuu_forward_seconds", "Seconds inside the decoder's forwards", value=m.forward_s)
        yield CounterMetricFamily(
            "dejavuu_shared_forwards", "Forwards that verified two or more requests at once", value=m.shared_forwards
        )
        yield CounterMetricFamily("dejavuu_forward_rows", "Request rows fed to the decoder", value=m.batch_rows)
        drafted = CounterMetricFamily("dejavuu_drafted_tokens", "Draft tokens verified, by method", labels=["method"])
        accepted = CounterMetricFamily("dejavuu_accepted_tokens", "Draft tokens accepted, by method", labels=["method"])
        rate = GaugeMetricFamily("dejavuu_acceptance_rate", "Accepted / drafted tokens, by method", labels=["method"])
        for k in sorted(m.drafted):
            drafted.add_metric([k], m.drafted[k])
            accepted.add_metric([k], m.accepted.get(k, 0))
            rate.add_metric([k], m.accepted.get(k, 0) / m.drafted[k] if m.drafted[k] else 0.0)
        yield drafted
        yield accepted
        yield rate
        if s.memory is not None:
            yield GaugeMetricFamily(
                "dejavuu_memory_tokens", "Tokens held by the cross-request drafter memory", value=s.memory.tokens()
            )
            yield CounterMetricFamily(
                "dejavuu_memory_evicted_tokens", "Tokens evicted from the drafter memory", value=s.memory.evicted_tokens
            )


def render_metrics(scheduler) -> str:
    reg = getattr(scheduler, "_prom_registry", None)
    if reg is None:
        reg = CollectorRegistry()
        reg.register(_Collector(scheduler))
        scheduler._prom_registry = reg
    return generate_latest(reg).decode()
