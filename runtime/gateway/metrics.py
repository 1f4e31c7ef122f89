"""Prometheus metrics of the gateway: its own request timings and the scheduler's gauges.

Each gateway has its own registry (no global state). Scheduler facts come from one
``Client.status()`` per scrape, held in ``Metrics.status`` while the registry is rendered,
and from each request's final result (its time in the scheduler's queue).

With several gateway processes (``[http] workers``), each keeps its counters and histograms in
prometheus-client's multiprocess files (``PROMETHEUS_MULTIPROC_DIR``, set by ``runtime up``
for them) and a scrape, served by any one of them, sums every process's values. The prefix
cache hit ratio is computed at each scrape from the summed token counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from runtime.client import GenerationResult
from runtime.protocol.client import StatusReply

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class _SchedulerCollector(Collector):
    """Gauges and the restart counter from the last status reply (nothing before the first scrape)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator:
        status, model = self._metrics.status, self._metrics.model
        if status is None:
            return
        used = 1.0 - status.kv_slots_free / status.kv_slots_total if status.kv_slots_total else 0.0
        for name, doc, value in (
            ("runtime_num_requests_running", "Requests decoding in the scheduler.", status.running),
            ("runtime_num_requests_waiting", "Requests queued in the scheduler.", status.waiting),
            ("runtime_kv_cache_usage_ratio", "Share of KV slots not free (1 - free/total).", used),
        ):
            family = GaugeMetricFamily(name, doc, labels=["model"])
            family.add_metric([model], value)
            yield family
        restarts = CounterMetricFamily("runtime_worker_restarts", "Worker restarts since start-up.", labels=["model"])
        restarts.add_metric([model], status.worker_restarts)
        yield restarts


class _HitRatioCollector(Collector):
    """``runtime_prefix_cache_hit_ratio``: cached / prompt tokens of the finished requests, from
    the token counters as ``families`` collects them (one process's, or every process's summed).
    ``forward``: also yield those families (they are the scrape's: read once per scrape)."""

    def __init__(self, families: Callable[[], Iterable[Metric]], model: str, forward: bool = False) -> None:
        self._families, self._model, self._forward = families, model, forward

    def collect(self) -> Iterator:
        families = list(self._families())
        if self._forward:
            yield from families
        totals: dict[str, float] = {}
        for family in families:
            for sample in family.samples:
                if sample.name in _TOKEN_TOTALS and sample.labels.get("model") == self._model:
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        prompt = totals.get("runtime_prompt_tokens_total", 0.0)
        ratio = totals.get("runtime_cached_prompt_tokens_total", 0.0) / prompt if prompt else 0.0
        family = GaugeMetricFamily("runtime_prefix_cache_hit_ratio",
                                   "Cached prompt tokens / prompt tokens of the requests the gateway served.",
                                   labels=["model"])
        family.add_metric([self._model], ratio)
        yield family


_TOKEN_TOTALS = ("runtime_prompt_tokens_total", "runtime_cached_prompt_tokens_total")


class Metrics:
    """The gateway's registry; ``record_*`` are called per choice, ``render`` per scrape.
    ``multiprocess_dir``: the shared directory of several gateway processes (None: one)."""

    def __init__(self, model: str, multiprocess_dir: str | None = None) -> None:
        self.model = model
        self.status: StatusReply | None = None
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model"]
        self.ttft = Histogram("runtime_time_to_first_token_seconds", "Time from arrival to the first token.",
                              labels, registry=r, buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("runtime_inter_token_latency_seconds", "Time between tokens of a request.",
                             labels, registry=r, buckets=_ITL_BUCKETS)
        self.e2e = Histogram("runtime_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             labels, registry=r, buckets=_LATENCY_BUCKETS)
        self.queue_time = Histogram("runtime_request_queue_time_seconds",
                                    "Time a request waited in the scheduler, from arrival to its admission "
                                    "(the step with its first prefill).", labels, registry=r, buckets=_LATENCY_BUCKETS)
        self.prompt_tokens = Counter("runtime_prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r)
        self.generation_tokens = Counter("runtime_generation_tokens", "Generated tokens.", labels, registry=r)
        self.cached_tokens = Counter("runtime_cached_prompt_tokens", "Prompt tokens found in the prefix cache.",
                                     labels, registry=r)
        self.requests = Counter("runtime_requests", "Finished requests by finish reason.",
                                ["model", "finish_reason"], registry=r)
        if multiprocess_dir is None:
            self._scraped = self.registry
            tokens = (self.prompt_tokens, self.cached_tokens)
            self.registry.register(_HitRatioCollector(lambda: [f for c in tokens for f in c.collect()], model))
        else:  # a scrape reads every process's files once, not this registry
            self._scraped = CollectorRegistry()
            every = MultiProcessCollector(None, path=multiprocess_dir)
            self._scraped.register(_HitRatioCollector(every.collect, model, forward=True))
        self._scraped.register(_SchedulerCollector(self))
        # The model's children, looked up once: ITL is recorded for every streamed chunk.
        self._ttft, self._itl, self._e2e = (h.labels(model) for h in (self.ttft, self.itl, self.e2e))
        self._queue_time = self.queue_time.labels(model)

    def record_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def record_tokens(self, count: int, seconds: float) -> None:
        """``count`` new tokens arrived ``seconds`` after the previous ones (one ITL sample each)."""
        if count:
            per_token = seconds / count
            for _ in range(count):
                self._itl.observe(per_token)

    def record_finish(self, result: GenerationResult, seconds: float) -> None:
        """A request ended ``seconds`` after the gateway sent it."""
        self._e2e.observe(seconds)
        if result.queue_s is not None:  # None: never admitted (refused, or aborted while waiting)
            self._queue_time.observe(result.queue_s)
        self.generation_tokens.labels(self.model).inc(len(result.token_ids))
        self.requests.labels(self.model, result.finish_reason).inc()
        self.prompt_tokens.labels(self.model).inc(result.prompt_tokens)
        self.cached_tokens.labels(self.model).inc(result.cached_tokens)

    def render(self, status: StatusReply | None) -> bytes:
        """The text exposition; ``status`` None (scheduler silent) leaves its gauges out."""
        self.status = status
        return generate_latest(self._scraped)
