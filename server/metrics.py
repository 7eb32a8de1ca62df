"""Server-wide Prometheus metrics under vLLM's names, one registry per app.

Gauges are read from `engine.stats()` at scrape time; counters and histograms are fed by the
outputs the server streams to its clients.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from stages.api import RequestMetrics

_LATENCY_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's REQUEST_PARAMS_N_BUCKETS
_PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)  # vLLM's REQUEST_NUM_PREEMPTIONS_BUCKETS

# Gauges a dashboard expects even before the engine reports them.
_ENGINE_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_:]")
_LABELLED = re.compile(r"(?P<name>[^{]+)\{(?P<labels>.*)\}", re.DOTALL)
_LABEL = re.compile(r'\s*(\w+)=("(?:[^"\\]|\\.)*"|[^,]*)')


class _EngineStatsCollector(Collector):
    """Turns `engine.stats()` into gauges (and `*_total` keys into counters) at scrape time."""

    def __init__(
        self, stats: Callable[[], Mapping[str, float]], model_name: str, owned: frozenset[str]
    ) -> None:
        self._stats = stats
        self._model_name = model_name
        self._owned = owned  # names the server itself exports; the engine's copies are skipped

    def collect(self) -> Iterator[Metric]:
        # name -> {labels: value}; a key `name{label=value,...}` is one labelled sample (the
        # data-parallel engine labels each replica's `engine`)
        values: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for key, value in self._stats().items():
            labelled = _LABELLED.fullmatch(key)
            name, labels = (
                (labelled["name"], _labels(labelled["labels"])) if labelled else (key, ())
            )
            name = _NAME_UNSAFE.sub("_", name.removeprefix("vllm:"))
            values.setdefault(name, {})[labels] = float(value)
        for name in _ENGINE_GAUGES:
            values.setdefault(name, {(): 0.0})
        yield from self._histograms(values)
        for name, samples in sorted(values.items()):
            full = f"vllm:{name}"
            if full in self._owned:
                continue
            extra = sorted({label for labels in samples for label, _ in labels})
            if name.endswith("_total"):
                family: CounterMetricFamily | GaugeMetricFamily = CounterMetricFamily(
                    full.removesuffix("_total"),
                    f"engine counter {name}",
                    labels=["model_name", *extra],
                )
            else:
                family = GaugeMetricFamily(
                    full, f"engine gauge {name}", labels=["model_name", *extra]
                )
            for labels, value in samples.items():
                given = dict(labels)
                family.add_metric([self._model_name, *(given.get(e, "") for e in extra)], value)
            yield family

    def _histograms(
        self, values: dict[str, dict[tuple[tuple[str, str], ...], float]]
    ) -> Iterator[Metric]:
        """The engine's histograms, taken out of `values`: a name whose samples carry an `le`
        label holds cumulative bucket counts, and `<name>_sum` their sum."""
        names = [n for n, samples in values.items() if any("le" in dict(k) for k in samples)]
        for name in sorted(names):
            samples, sums = values.pop(name), values.pop(f"{name}_sum", {})
            full = f"vllm:{name}"
            if full in self._owned:
                continue
            series: dict[tuple[tuple[str, str], ...], list[tuple[str, float]]] = {}
            for labels, value in samples.items():
                rest = tuple((k, v) for k, v in labels if k != "le")
                bound = floatToGoString(float(dict(labels)["le"]))  # as prometheus writes it
                series.setdefault(rest, []).append((bound, value))
            extra = sorted({label for labels in series for label, _ in labels})
            family = HistogramMetricFamily(
                full, f"engine histogram {name}", labels=["model_name", *extra]
            )
            for labels, buckets in series.items():
                given = dict(labels)
                buckets.sort(key=lambda bucket: float(bucket[0]))  # "+Inf" sorts last
                family.add_metric(
                    [self._model_name, *(given.get(e, "") for e in extra)],
                    buckets,
                    sums.get(labels, 0.0),
                )
            yield family


# vLLM's ORCA load report: the header a request asks for with endpoint-load-metrics-format.
ORCA_METRICS = (("kv_cache_usage_perc", "kv_cache_usage_perc"),
                ("num_requests_waiting", "num_requests_waiting"))  # fmt: skip


def orca_header(metrics_format: str, stats: Mapping[str, float]) -> str | None:
    """`endpoint-load-metrics`' value (vLLM's: `TEXT named_metrics.a=0.4, ...` or `JSON
    {"named_metrics": {...}}`) from the engine's gauges (data-parallel replicas: waiting summed,
    cache use averaged); None for a format other than TEXT or JSON."""
    kind = metrics_format.strip().lower()
    if kind not in ("text", "json"):
        return None
    samples: dict[str, list[float]] = {}
    for key, value in stats.items():
        labelled = _LABELLED.fullmatch(key)
        name = (labelled["name"] if labelled else key).removeprefix("vllm:")
        samples.setdefault(name, []).append(float(value))
    named: dict[str, float] = {}
    for source, orca_name in ORCA_METRICS:
        values = samples.get(source, [0.0])
        total = sum(values)
        named[orca_name] = total / len(values) if source == "kv_cache_usage_perc" else total
    if kind == "json":
        return "JSON " + json.dumps({"named_metrics": named})
    return "TEXT " + ", ".join(f"named_metrics.{name}={value}" for name, value in named.items())


def _labels(text: str) -> tuple[tuple[str, str], ...]:
    """`engine=1,position=0` as ((engine, 1), (position, 0)); a value may be a JSON string
    (`adapters="a,b"`), for one that holds commas."""
    return tuple(
        (label, json.loads(value) if value.startswith('"') else value.strip())
        for label, value in _LABEL.findall(text)
    )


class _PerTokenCollector(Collector):
    """The two metrics fed once per streamed token: the generation-token counter and the
    inter-token-latency histogram. They are plain numbers updated on the event loop (a bisect and
    two adds) and turned into metric families at scrape time: prometheus_client's Counter.inc and
    Histogram.observe take a lock each and cost about a third of the server's own Python per token.
    One set per engine (`series`: each engine's label values).
    """

    def __init__(
        self, labels: list[str], series: list[list[str]], itl_buckets: tuple[float, ...]
    ) -> None:
        self._labels = labels
        self._series = series
        self.generation_tokens = [0] * len(series)
        self._bounds = itl_buckets
        self._counts = [[0] * (len(itl_buckets) + 1) for _ in series]  # the last one is +Inf
        self._itl_sums = [0.0] * len(series)

    def observe_itl(self, engine: int, seconds: float, times: int) -> None:
        self._counts[engine][bisect_left(self._bounds, seconds)] += times
        self._itl_sums[engine] += seconds * times

    def collect(self) -> Iterator[Metric]:
        tokens = CounterMetricFamily(
            "vllm:generation_tokens", "Generation tokens produced.", labels=self._labels
        )
        for values, count in zip(self._series, self.generation_tokens, strict=True):
            tokens.add_metric(values, count)
        yield tokens
        itl = HistogramMetricFamily(
            "vllm:inter_token_latency_seconds", "Time between output tokens.", labels=self._labels
        )
        bounds = (*map(str, self._bounds), "+Inf")
        for values, counts, total in zip(self._series, self._counts, self._itl_sums, strict=True):
            cumulative, buckets = 0, []
            for bound, count in zip(bounds, counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            itl.add_metric(values, buckets, total)
        yield itl


class ServerMetrics:
    """What the server counts itself, under vLLM's names and labels: `model_name`, and with more
    than one data-parallel replica `engine` (the replica that served the request)."""

    def __init__(
        self, stats: Callable[[], Mapping[str, float]], model_name: str, num_engines: int = 1
    ) -> None:
        self.registry = CollectorRegistry()
        self._labels = ["model_name", "engine"] if num_engines > 1 else ["model_name"]
        # each engine's label values, by its index
        self._series = (
            [[model_name, str(e)] for e in range(num_engines)]
            if num_engines > 1
            else [[model_name]]
        )
        self._owned: set[str] = set()  # names exported here; the engine's copies are skipped
        self._declare_latencies()
        self._declare_counts()
        self._per_token = _PerTokenCollector(self._labels, self._series, _LATENCY_BUCKETS_S)
        self.registry.register(self._per_token)
        self._owned.update(
            (
                "vllm:generation_tokens",
                "vllm:generation_tokens_total",
                "vllm:inter_token_latency_seconds",
            )
        )
        self.registry.register(_EngineStatsCollector(stats, model_name, frozenset(self._owned)))
        # The per-token paths use these children directly: `.labels()` costs a lock and a lookup.
        self._prompt_tokens = [self.prompt_tokens.labels(*values) for values in self._series]
        self._ttft = [self.ttft.labels(*values) for values in self._series]

    def _counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        self._owned.update((name, f"{name}_total"))
        counter = Counter(name, doc, [*self._labels, *extra], registry=self.registry)
        if not extra:
            self._every_engine(counter)
        return counter

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        self._owned.add(name)
        histogram = Histogram(name, doc, self._labels, buckets=buckets, registry=self.registry)
        self._every_engine(histogram)
        return histogram

    def _every_engine(self, metric: Counter | Histogram) -> None:
        """Each engine's series from the start, at zero (as vLLM's): a replica that has served
        nothing yet is there to see, and a rate over it has a first sample."""
        for values in self._series:
            metric.labels(*values)

    def _declare_latencies(self) -> None:
        """The prompt and success counters and each request's latencies (vLLM's names)."""
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.request_success = self._counter(
            "vllm:request_success", "Finished requests by finish reason.", ("finished_reason",)
        )
        self.ttft = self._histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS_S
        )
        self.e2e = self._histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last output.", _LATENCY_BUCKETS_S
        )
        self.queue = self._histogram(
            "vllm:request_queue_time_seconds", "Time waiting to be scheduled.", _LATENCY_BUCKETS_S
        )
        self.prefill = self._histogram(
            "vllm:request_prefill_time_seconds", "Time in prefill.", _LATENCY_BUCKETS_S
        )
        self.decode = self._histogram(
            "vllm:request_decode_time_seconds", "Time in decode.", _LATENCY_BUCKETS_S
        )
        self.inference = self._histogram(
            "vllm:request_inference_time_seconds", "Prefill plus decode.", _LATENCY_BUCKETS_S
        )

    def _declare_counts(self) -> None:
        """Each request's token counts and parameters, and the cached prompt tokens."""
        self.request_prompt_tokens = self._histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = self._histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS
        )
        self.request_params_n = self._histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS
        )
        self.request_max_generation_tokens = self._histogram(
            "vllm:request_max_num_generation_tokens",
            "Most generation tokens of one request's choices.",
            _TOKEN_BUCKETS,
        )
        self.request_params_max_tokens = self._histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            _TOKEN_BUCKETS,
        )
        self.request_num_preemptions = self._histogram(
            "vllm:request_num_preemptions",
            "Times a request was preempted.",
            _PREEMPTION_BUCKETS,
        )
        self.time_per_output_token = self._histogram(
            "vllm:request_time_per_output_token_seconds",
            "Decode time per output token after the first, per request.",
            _LATENCY_BUCKETS_S,
        )
        self.prompt_tokens_cached = self._counter(
            "vllm:prompt_tokens_cached", "Prompt tokens taken from the prefix cache."
        )
        self.request_prefill_kv_computed = self._histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            _TOKEN_BUCKETS,
        )

    def observe_first_output(self, num_prompt_tokens: int, ttft_s: float, engine: int = 0) -> None:
        self._prompt_tokens[engine].inc(num_prompt_tokens)
        self._ttft[engine].observe(ttft_s)

    def observe_tokens(self, num_new_tokens: int, gap_s: float | None, engine: int = 0) -> None:
        """`gap_s`: time since the previous output, spread over the tokens it brought."""
        if num_new_tokens <= 0:
            return
        self._per_token.generation_tokens[engine] += num_new_tokens
        if gap_s is not None:
            self._per_token.observe_itl(engine, gap_s / num_new_tokens, num_new_tokens)

    def observe_finish(
        self,
        finish_reason: str,
        e2e_s: float,
        num_prompt_tokens: int,
        num_output_tokens: int,
        metrics: RequestMetrics | None,
        max_tokens: int | None = None,
        engine: int = 0,
    ) -> None:
        """One engine request (one choice) finished; `max_tokens` as the request set it."""
        labels = self._series[engine]
        self.request_success.labels(*labels, finish_reason).inc()
        self.e2e.labels(*labels).observe(e2e_s)
        self.request_prompt_tokens.labels(*labels).observe(num_prompt_tokens)
        self.request_generation_tokens.labels(*labels).observe(num_output_tokens)
        if max_tokens:  # as vLLM: only a request that set one
            self.request_params_max_tokens.labels(*labels).observe(max_tokens)
        if metrics is not None:
            self._observe_stages(labels, num_prompt_tokens, metrics)

    def _observe_stages(
        self, labels: list[str], num_prompt_tokens: int, metrics: RequestMetrics
    ) -> None:
        """A finished choice's times in each phase, preemptions and prompt tokens computed."""
        self.queue.labels(*labels).observe(metrics.queue_s)
        self.prefill.labels(*labels).observe(metrics.prefill_s)
        self.decode.labels(*labels).observe(metrics.decode_s)
        self.inference.labels(*labels).observe(metrics.prefill_s + metrics.decode_s)
        self.request_num_preemptions.labels(*labels).observe(metrics.num_preemptions)
        self.prompt_tokens_cached.labels(*labels).inc(metrics.num_cached_prompt_tokens)
        computed = num_prompt_tokens - max(metrics.num_cached_prompt_tokens, 0)
        self.request_prefill_kv_computed.labels(*labels).observe(computed)
        # vLLM's: the first token came with the prefill, so it is not counted
        after_first = metrics.num_generated_tokens - 1
        per_token = metrics.decode_s / after_first if after_first > 0 else 0.0
        self.time_per_output_token.labels(*labels).observe(per_token)

    def observe_request(self, n: int, max_num_generation_tokens: int, engine: int = 0) -> None:
        """A request's n choices all finished: its n, and the most tokens one of them made."""
        labels = self._series[engine]
        self.request_params_n.labels(*labels).observe(n)
        self.request_max_generation_tokens.labels(*labels).observe(max_num_generation_tokens)

    def structured_outputs(self, requested: str, backend: str) -> None:
        """What compiles the grammars (`backend`, vLLM's name for it) and the backend that
        --structured-outputs-config asked for, as an info gauge."""
        info = Gauge(
            "vllm:structured_outputs_info",
            "The structured-outputs backend that compiles grammars, and the one asked for.",
            ["model_name", "backend", "requested"],
            registry=self.registry,
        )
        info.labels(self._series[0][0], backend, requested).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
