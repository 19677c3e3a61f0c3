"""The engine's Prometheus metrics: each one defined once here, recorded through Ray's metrics API.

Ray's per-node metrics agent exports them in Prometheus format on the node's metrics export port
(`specdec serve --metrics-port`, default 8080; `ray start --metrics-export-port` on a cluster), next
to Ray's and Serve's own, with Ray's `ray_` prefix and a `_total` suffix on counters:
`ray_specdec_num_accepted_tokens_total`. Ray writes a Prometheus file-service-discovery file
listing every node (`/tmp/ray/prom_metrics_service_discovery.json` on the head node), so a cluster
needs no ports of ours. No actor serves HTTP.

The coordinator records them at request-level events (`RequestMetrics.prefilled`, `.step`,
`.finished`), from what each step already returns (the proposal, the verification result, the
committed chunk), so a change to the loop keeps one recording point. The gauges are also re-set
every `GAUGE_REFRESH_S` (`EngineMetrics.refresh`, from the coordinator's event loop), because Ray
exports a gauge only while it is being set: a worker sends the agent only the gauge values set since
its last report (every `REPORT_INTERVAL_MS`; Ray's observable-gauge callback clears them once
collected), and the agent drops a value not re-sent within two of its own report intervals
(`OpenTelemetryMetricRecorder._gauge_metric_ttl_s` in Ray 2.60; 20 s measured: the agent keeps
Ray's default 10 s interval while our workers report every 2 s). Set at events only, an idle
engine's gauges left the exposition some 20 s after its last request and the dashboard's gauge
panels went blank.

The counters are the sums of the `speculative` objects the clients get (`specdec/decoding/stats.py` defines
the words), so:

    acceptance rate          sum(rate(ray_specdec_num_accepted_tokens_total[5m]))
                               / sum(rate(ray_specdec_num_draft_tokens_total[5m]))
    mean accepted length     1 + sum(rate(ray_specdec_num_accepted_tokens_total[5m]))
                               / sum(rate(ray_specdec_num_drafts_total[5m]))
    acceptance by position   sum by (position) (rate(ray_specdec_num_accepted_tokens_per_pos_total[5m]))
                               / ignoring(position) group_left sum(rate(ray_specdec_num_drafts_total[5m]))
    tokens per target forward  sum(rate(ray_specdec_generation_tokens_total[5m]))
                               / sum(rate(ray_specdec_target_forwards_total[5m]))
    p99 time to first token  histogram_quantile(0.99,
                               sum by (le) (rate(ray_specdec_time_to_first_token_seconds_bucket[5m])))

(the same as vLLM's spec-decode metrics: `num_drafts` counts verify steps that checked at least one
draft token; mean accepted length counts the recovered or bonus token of each step).

Labels: `model_name` (the served model name) and `replica` (the Serve replica; "0" outside
Serve), plus Ray's own (`WorkerId`, `NodeAddress`, `SessionName`, ...): sum over Ray's labels.
`finish_reason` is stop, length, error, cancelled or timeout; `role` is draft or target;
`position` counts from 0. `specdec_engine_info` is an info metric (always 1) whose labels say how
the engine runs: `target_precision` (float32, int4 or int8-weight), `linear_kernel` (the target's
float32 linears'), `draft_precision` (the draft model's: "none" for
one run as loaded, "no draft" for n-gram lookup or target-only), `cpu` (the CPU model the target's
kernel was measured on: its shard's node) and `isa` (its widest vector ISA: amx, avx512, avx2 or
baseline).

Histograms: Ray's agent re-emits each observation at its bucket's midpoint, so a histogram's
`_sum` is approximate (quantiles and counts are not affected). `specdec_accepted_length` has
buckets at half-integers, so its midpoints are the integers it counts and its `_sum` is exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

#: How often workers hand their metrics to the node's agent (Ray's default is 10 s).
REPORT_INTERVAL_MS = 2000
#: How often the coordinator re-sets the gauges: within every report, so that none lapses (see above).
GAUGE_REFRESH_S = REPORT_INTERVAL_MS / 2000

FINISH_REASONS = ("stop", "length", "error", "cancelled", "timeout")
ROLES = ("draft", "target")
LABELS = ("model_name", "replica")

_LATENCY = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
_FIRST_TOKEN = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0]
_REQUEST = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0]
MAX_ACCEPTED_LENGTH = 32  # a step commits at most K + 1 tokens; longer steps (K > 31) fall in +Inf
_ACCEPTED_LENGTH = [i + 0.5 for i in range(MAX_ACCEPTED_LENGTH + 1)]
_ACCEPTANCE = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0]


@dataclass(frozen=True)
class MetricSpec:
    kind: str  # counter | gauge | histogram
    name: str
    description: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


def _c(name, description, *labels):
    return MetricSpec("counter", name, description, labels)


def _g(name, description, *labels):
    return MetricSpec("gauge", name, description, labels)


def _h(name, description, buckets, *labels):
    return MetricSpec("histogram", name, description, labels, tuple(buckets))


#: Every metric the engine exports (names before Ray's `ray_` prefix and the counters' `_total`).
METRICS = {spec.name: spec for spec in (
    _c("specdec_num_drafts", "Verify steps that checked at least one draft token."),
    _c("specdec_num_draft_tokens", "Draft tokens proposed and verified."),
    _c("specdec_num_accepted_tokens", "Draft tokens the target accepted."),
    _c("specdec_num_accepted_tokens_per_pos", "Verify steps whose draft token at this position (from 0) was "
                                              "accepted.", "position"),
    _c("specdec_target_forwards", "Target forward passes after the prompt's prefill (one per verify step)."),
    _c("specdec_prompt_tokens", "Prompt tokens prefilled."),
    _c("specdec_generation_tokens", "Tokens generated (committed to outputs)."),
    _c("specdec_requests", "Requests finished, by finish reason (stop, length, error, cancelled, timeout).",
       "finish_reason"),
    _c("specdec_kv_rewinds", "KV-cache rewinds that dropped at least one token (rejected or unused draft "
                             "tokens).", "role"),
    _c("specdec_kv_rewound_tokens", "Tokens dropped from KV caches by rewinds.", "role"),
    _c("specdec_pipeline_hits", "Pre-drafted blocks used as the next proposal (pipelined separate draft)."),
    _c("specdec_pipeline_misses", "Pre-drafted blocks thrown away (a rejection, or the bonus token differed)."),
    _c("specdec_draft_failures", "Draft calls that failed; the request went on target-only."),
    _c("specdec_prefix_cache_queries", "Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries)."),
    _c("specdec_prefix_cache_hits", "Prompt tokens the prefix cache served: their KV copied, not computed (vLLM's "
                                    "prefix_cache_hits)."),
    _c("specdec_prefix_cache_evictions", "Cached prefixes evicted (least recently used first) to make room in "
                                         "the KV budget."),
    _g("specdec_kv_cache_usage", "The KV budget in use (0-1): the running requests' reservations plus the cached "
                                 "prefixes, over kv_cache_memory."),
    _g("specdec_requests_running", "Requests generating in this engine."),
    _g("specdec_requests_waiting", "Requests admitted by this engine and waiting for its target shards (start-up "
                                   "or a rebuild of the shard group)."),
    _g("specdec_num_speculative_tokens", "K of the last verify step (the number of draft tokens asked for); 0 "
                                         "while no request runs."),
    _g("specdec_kv_cache_tokens", "Tokens held in the KV caches of the requests in flight.", "role"),
    _g("specdec_engine_info", "How the engine runs (always 1): the target's precision and linear kernel, the "
                              "draft model's precision ('none': run as loaded; 'no draft': n-gram or "
                              "target-only), the CPU model and its widest vector ISA.",
       "target_precision", "linear_kernel", "draft_precision", "cpu", "isa"),
    _h("specdec_time_to_first_token_seconds", "From a request's arrival at the engine to its first token.",
       _FIRST_TOKEN),
    _h("specdec_inter_token_latency_seconds", "Time between a request's steps, divided over the tokens the step "
                                              "committed (one observation per token).", _LATENCY),
    _h("specdec_request_latency_seconds", "From a request's arrival at the engine to its last token (stop or "
                                          "length).", _REQUEST),
    _h("specdec_draft_latency_seconds", "One drafting call, as the coordinator waits for it (pre-drafted blocks "
                                        "used cost no wait and are not observed).", _LATENCY),
    _h("specdec_verify_latency_seconds", "One target verify forward over all shards, as the coordinator waits "
                                         "for it.", _LATENCY),
    _h("specdec_accepted_length", "Tokens committed per verify step that checked draft tokens (accepted + 1).",
       _ACCEPTED_LENGTH),
    _h("specdec_request_acceptance_rate", "Each finished request's acceptance rate (accepted / proposed draft "
                                          "tokens; requests that proposed none are not observed), by the features "
                                          "it used (`request_features`).", _ACCEPTANCE, "features"),
)}


def request_features(sampling, tools: bool = False) -> str:
    """The request features that change what speculation costs, as one label value: "plain", or the
    ones in use joined by "+" (logprobs; penalties: any bias or penalty; json_schema: JSON output;
    grammar: a regex, choice or Lark grammar; tools: tool definitions in the prompt)."""
    penalties = bool(sampling.presence_penalty or sampling.frequency_penalty or sampling.repetition_penalty != 1.0
                     or sampling.logit_bias)
    structured = sampling.structured.label if sampling.structured is not None else None
    used = [name for name, on in (("logprobs", sampling.logprobs is not None), ("penalties", penalties),
                                  ("json_schema", structured == "json_schema"), ("grammar", structured == "grammar"),
                                  ("tools", tools)) if on]
    return "+".join(used) or "plain"

_created: dict[str, object] = {}  # one Ray metric object per name in this process


def _metric(name: str):
    metric = _created.get(name)
    if metric is None:
        from ray.util import metrics

        spec = METRICS[name]
        tag_keys = LABELS + spec.labels
        if spec.kind == "counter":
            metric = metrics.Counter(name, description=spec.description, tag_keys=tag_keys)
        elif spec.kind == "gauge":
            metric = metrics.Gauge(name, description=spec.description, tag_keys=tag_keys)
        else:
            metric = metrics.Histogram(name, description=spec.description, boundaries=list(spec.buckets),
                                       tag_keys=tag_keys)
        _created[name] = metric
    return metric


class EngineMetrics:
    """The metrics of one engine (a coordinator): its labels and its gauges' current state."""

    def __init__(self, model_name: str, replica: str = "0", speculative_tokens_limit: int = 8) -> None:
        self.tags = {"model_name": model_name, "replica": replica}
        self._waiting = 0
        self._running: dict[str, list[int]] = {}  # request id -> [target, draft] KV-cache tokens
        self._k = 0  # K of the last verify step
        self._kv_usage = 0.0  # the KV budget in use (`kv`)
        self._evictions = 0  # cached prefixes evicted so far (the scheduler's count)
        self._info: dict[str, str] | None = None  # specdec_engine_info's labels, once the engine runs
        self._zero_counters(speculative_tokens_limit)
        self._set_gauges()

    def engine_started(self, info: dict) -> None:
        """Record `specdec_engine_info` from the coordinator's `info` (the rank-0 shard's `describe()`,
        with the draft's calibration) and this node's CPU."""
        from specdec.kernels.cpu import cpu_info

        calibration = info.get("calibration") or {}
        kernel = calibration.get("linear_kernel") or {}
        cpu = cpu_info()
        self._info = {"target_precision": str((calibration.get("target_precision") or {}).get("choice")
                                              or info.get("target_precision") or "float32"),
                      "linear_kernel": str(kernel.get("choice") or info.get("linear_kernel")),
                      "draft_precision": str((calibration.get("draft_precision") or {}).get("choice") or "no draft"),
                      # The CPU the target's kernel was measured on (its shard's node), else this node's.
                      "cpu": kernel.get("cpu") or cpu.model, "isa": kernel.get("isa") or cpu.isa}
        self._set_gauges()

    def refresh(self) -> None:
        """Re-set every gauge to its current value: Ray drops a gauge that is not set again within a
        few report intervals (the module docstring says why), so the coordinator calls this every
        `GAUGE_REFRESH_S`, busy or idle."""
        self._set_gauges()

    def kv(self, usage: float | None, evictions: int) -> None:
        """The KV budget in use and the prefix cache's evictions so far (the scheduler's figures)."""
        self._kv_usage = usage or 0.0
        if evictions > self._evictions:
            self.inc("specdec_prefix_cache_evictions", evictions - self._evictions)
            self._evictions = evictions
        self.set("specdec_kv_cache_usage", self._kv_usage)

    def _zero_counters(self, speculative_tokens_limit: int) -> None:
        """Export every counter series from the start, at 0: `rate()` cannot see the first increase of
        a series that appears with it, and a panel of a counter that never moved (draft failures)
        shows 0 rather than nothing. Ray's `Counter.inc` refuses 0, so the record call is used."""
        extra = {"specdec_requests": [{"finish_reason": r} for r in FINISH_REASONS],
                 "specdec_kv_rewinds": [{"role": r} for r in ROLES],
                 "specdec_kv_rewound_tokens": [{"role": r} for r in ROLES],
                 "specdec_num_accepted_tokens_per_pos": [{"position": str(i)}
                                                         for i in range(speculative_tokens_limit)]}
        for name, spec in METRICS.items():
            metric = _metric(name)
            if spec.kind == "counter":
                for labels in extra.get(name, [{}]):
                    metric._record(0, tags={**self.tags, **labels})

    # -------------------------------------------------------------------------------- record

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        if value:
            _metric(name).inc(value, tags={**self.tags, **labels})

    def set(self, name: str, value: float, **labels: str) -> None:
        _metric(name).set(value, tags={**self.tags, **labels})

    def observe(self, name: str, value: float, times: int = 1, **labels: str) -> None:
        metric = _metric(name)
        for _ in range(times):
            metric.observe(value, tags={**self.tags, **labels})

    def _set_gauges(self) -> None:
        self.set("specdec_requests_waiting", self._waiting)
        self.set("specdec_requests_running", len(self._running))
        self.set("specdec_num_speculative_tokens", self._k if self._running else 0)
        for i, role in enumerate(("target", "draft")):
            self.set("specdec_kv_cache_tokens", sum(held[i] for held in self._running.values()), role=role)
        self.set("specdec_kv_cache_usage", self._kv_usage)
        if self._info is not None:
            self.set("specdec_engine_info", 1, **self._info)

    # ------------------------------------------------------------------------------ requests

    def arrived(self, request_id: str, features: str = "plain") -> "RequestMetrics":
        """A request passed validation and waits for the engine (see `RequestMetrics`)."""
        self._waiting += 1
        self.set("specdec_requests_waiting", self._waiting)
        return RequestMetrics(self, request_id, features)


class RequestMetrics:
    """One request's recording point: its clock, what it holds in the caches, its acceptance."""

    def __init__(self, engine: EngineMetrics, request_id: str, features: str = "plain") -> None:
        self.engine = engine
        self.request_id = request_id
        self.features = features
        self.proposed = self.accepted = 0
        self.arrived = time.perf_counter()
        self.last_token: float | None = None  # when the last step committed (None: no token yet)
        self.state = "waiting"  # waiting -> running -> finished

    def started(self) -> None:
        """The engine took the request (its shard group is ready): running from here."""
        engine = self.engine
        engine._waiting -= 1
        engine._running[self.request_id] = [0, 0]
        self.state = "running"
        engine._set_gauges()

    def prefilled(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.engine.inc("specdec_prompt_tokens", num_prompt_tokens)
        self.engine.inc("specdec_prefix_cache_queries", num_prompt_tokens)
        self.engine.inc("specdec_prefix_cache_hits", num_cached_tokens)
        self._hold(target=num_prompt_tokens - 1)  # the prefill holds all but the last prompt token

    def step(self, step) -> None:
        """One verify step committed: the core's `specdec.engine.step.StepInfo` for this request (the core's stats
        got the same numbers)."""
        engine, now = self.engine, time.perf_counter()
        engine._k = step.k  # set with the other gauges, by `_hold` below
        engine.inc("specdec_target_forwards")
        engine.observe("specdec_verify_latency_seconds", step.verify_seconds)
        if step.draft_seconds is not None:
            engine.observe("specdec_draft_latency_seconds", step.draft_seconds)
        if step.num_proposed:
            self.proposed += step.num_proposed
            self.accepted += step.num_accepted
            engine.inc("specdec_num_drafts")
            engine.inc("specdec_num_draft_tokens", step.num_proposed)
            engine.inc("specdec_num_accepted_tokens", step.num_accepted)
            for position in range(step.num_accepted):
                engine.inc("specdec_num_accepted_tokens_per_pos", position=str(position))
            engine.observe("specdec_accepted_length", step.num_accepted + 1)
        engine.inc("specdec_generation_tokens", step.num_committed)
        if step.num_committed:
            if self.last_token is None:
                engine.observe("specdec_time_to_first_token_seconds", now - self.arrived)
            else:
                engine.observe("specdec_inter_token_latency_seconds", (now - self.last_token) / step.num_committed,
                               times=step.num_committed)
            self.last_token = now
        if step.pipeline_hit is not None:
            engine.inc("specdec_pipeline_hits" if step.pipeline_hit else "specdec_pipeline_misses")
        engine.inc("specdec_draft_failures", step.draft_failures)
        for role, rewound in (("target", step.target_rewound_tokens), ("draft", step.draft_rewound_tokens)):
            if rewound:
                engine.inc("specdec_kv_rewinds", role=role)
                engine.inc("specdec_kv_rewound_tokens", rewound, role=role)
        self._hold(target=step.target_cache_tokens, draft=step.draft_cache_tokens)

    def finished(self, finish_reason: str) -> None:
        engine = self.engine
        if self.state == "waiting":
            engine._waiting -= 1
        engine._running.pop(self.request_id, None)
        if self.state != "finished":
            engine.inc("specdec_requests", finish_reason=finish_reason)
            if finish_reason in ("stop", "length"):
                engine.observe("specdec_request_latency_seconds", time.perf_counter() - self.arrived)
                if self.proposed:
                    engine.observe("specdec_request_acceptance_rate", self.accepted / self.proposed,
                                   features=self.features)
        self.state = "finished"
        engine._set_gauges()

    def _hold(self, target: int | None = None, draft: int | None = None) -> None:
        held = self.engine._running.get(self.request_id)
        if held is None:
            return
        if target is not None:
            held[0] = target
        if draft is not None:
            held[1] = draft
        self.engine._set_gauges()
