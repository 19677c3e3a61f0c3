"""The specdec Grafana dashboard, built with Grafana's typed builder (grafana-foundation-sdk).

    python monitoring/grafana/dashboard.py          # rewrites monitoring/grafana/specdec.json

The JSON is checked in (Grafana provisions it from monitoring/grafana/provisioning/):
`tests/monitoring/test_dashboard.py` checks that it is this script's output and that every query
parses (promtool), and `tests/deployments/test_cli_serve.py` evaluates every panel's query against
a real Prometheus scraping a real `specdec serve`. The metrics and their
meaning are defined once, in `actors/metrics.py`; panel descriptions say how to read each one.
"""

from __future__ import annotations

import json
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import (DataSourceRef, DataTransformerConfig, VariableOption,
                                                     VariableRefresh, VariableSort)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

OUTPUT = Path(__file__).with_name("specdec.json")
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SELECTOR = '{model_name=~"$model", replica=~"$replica"}'
RATE = "[$__rate_interval]"
ALL = VariableOption(selected=True, text=["All"], value=["$__all"])  # the variables start at All


def rate(metric: str, by: str = "") -> str:
    """sum [by (labels)] of the per-second rate of a counter (or histogram series) of the selection."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{SELECTOR}{RATE}))"


def quantile(q: float, histogram: str, by: str = "") -> str:
    """The q-quantile of a histogram over the selection [by (labels)]."""
    return f"histogram_quantile({q}, {rate(histogram + '_bucket', f'le, {by}' if by else 'le')})"


def p50_p99(histogram: str, legend: str = "") -> list[tuple[str, str]]:
    """The median and the 99th percentile of a histogram, as a panel's targets (legends `p50`, `p99`,
    after `legend`)."""
    return [(quantile(0.5, histogram), f"{legend}p50"), (quantile(0.99, histogram), f"{legend}p99")]


def query(expr: str, legend: str, ref: str = "A"):
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DATASOURCE)


def panel(kind, title: str, description: str, unit: str, targets: list[tuple[str, str]], width: int = 8):
    builder = {"timeseries": timeseries.Panel, "stat": stat.Panel, "bargauge": bargauge.Panel}[kind]()
    p = builder.title(title).description(description).unit(unit).datasource(DATASOURCE).span(width).height(8)
    for i, (expr, legend) in enumerate(targets):
        p = p.with_target(query(expr, legend, chr(ord("A") + i)))
    return p


ACCEPTED = "ray_specdec_num_accepted_tokens_total"
DRAFT_TOKENS = "ray_specdec_num_draft_tokens_total"
DRAFTS = "ray_specdec_num_drafts_total"
ENGINE_LABELS = ("model_name", "replica", "target_precision", "linear_kernel", "draft_precision", "cpu", "isa")


def build() -> dict:
    """The dashboard as Grafana's JSON model: a row each for acceptance, throughput, latency, the
    speculation internals and the engines, one function each below."""
    d = header()
    for title, panels in (("Acceptance", acceptance()), ("Throughput", throughput()), ("Latency", latency()),
                          ("Prefix cache and KV memory", memory()), ("Speculation internals", internals()),
                          ("Engine", [engine_table()])):
        d = d.with_row(dashboard.Row(title))
        for p in panels:
            d = d.with_panel(p)
    return json.loads(json.dumps(d.build(), cls=JSONEncoder))


def header():
    """The dashboard without panels: its settings and the variables every query selects by."""
    return (dashboard.Dashboard("specdec: speculative decoding")
            .uid("specdec")
            .description("Acceptance, speed and latency of specdec's speculative decoding engines (Ray metrics).")
            .tags(["specdec", "speculative-decoding", "ray"])
            .refresh("10s")
            .time("now-30m", "now")
            .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
            .with_variable(label_variable("model", "Model", "label_values(ray_specdec_requests_total, model_name)"))
            .with_variable(label_variable("replica", "Replica", 'label_values(ray_specdec_requests_total'
                                                                '{model_name=~"$model"}, replica)')))


def label_variable(name: str, label: str, values: str):
    """A variable over a label's values: several may be picked, All by default."""
    return (dashboard.QueryVariable(name).label(label).datasource(DATASOURCE).query(values)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
            .include_all(True).all_value(".*").multi(True).current(ALL))


def acceptance() -> list:
    return [
        panel("timeseries", "Acceptance rate",
              "Accepted draft tokens / proposed draft tokens, per model and per replica. What the draft buys: at "
              "acceptance a and K draft tokens a step commits (1 - a^(K+1)) / (1 - a) tokens on average.",
              "percentunit",
              [(f"{rate(ACCEPTED, 'model_name')} / {rate(DRAFT_TOKENS, 'model_name')}", "{{model_name}}"),
               (f"{rate(ACCEPTED, 'model_name, replica')} / {rate(DRAFT_TOKENS, 'model_name, replica')}",
                "{{model_name}} replica {{replica}}")]),
        panel("timeseries", "Mean accepted length",
              "Tokens committed per verify step that checked draft tokens (accepted + the recovered or bonus "
              "token): 1 + accepted / drafts. 1 means the draft never helps; K + 1 is the most a step can commit. "
              "The median comes from the accepted-length histogram.",
              "none",
              [(f"1 + {rate(ACCEPTED)} / {rate(DRAFTS)}", "mean"),
               (quantile(0.5, "ray_specdec_accepted_length"), "median")]),
        panel("bargauge", "Acceptance by position",
              "Share of verify steps whose draft token at each position (0 = first) was accepted. A steep fall "
              "says a smaller K would waste less drafting.",
              "percentunit",
              [(f"{rate('ray_specdec_num_accepted_tokens_per_pos_total', 'position')} / ignoring(position) "
                f"group_left {rate(DRAFTS)}", "position {{position}}")]),
        panel("timeseries", "Acceptance per request, by features",
              "Median and 10th percentile of finished requests' acceptance rates, by the features they used "
              "(plain, logprobs, penalties, json_schema, grammar, tools, joined by +). A feature whose requests "
              "accept less costs speculation speed; a request near 0 or 1 is often garbled or looping output.",
              "percentunit",
              [(quantile(0.5, "ray_specdec_request_acceptance_rate", by="features"), "median {{features}}"),
               (quantile(0.1, "ray_specdec_request_acceptance_rate", by="features"), "p10 {{features}}")],
              width=24),
    ]


def throughput() -> list:
    return [
        panel("timeseries", "Tokens per second",
              "Generated (committed) tokens per second, and prompt tokens prefilled per second, over all engines "
              "of the selection.",
              "short",
              [(rate("ray_specdec_generation_tokens_total"), "generated"),
               (rate("ray_specdec_prompt_tokens_total"), "prompt")]),
        panel("timeseries", "Tokens per target forward",
              "Generated tokens per target forward pass: 1.0 is plain decoding; the speed-up over it is this "
              "divided by the cost of a step (a verify forward plus drafting) relative to one forward.",
              "none",
              [(f"{rate('ray_specdec_generation_tokens_total', 'model_name')} / "
                f"{rate('ray_specdec_target_forwards_total', 'model_name')}", "{{model_name}}")]),
        panel("timeseries", "Requests",
              "Requests generating now, and those admitted by an engine but waiting for its target shards "
              "(start-up or a rebuild after a failed shard). Requests queued in Serve in front of the engine are "
              "Serve's ray_serve_* metrics.",
              "short",
              [(f"sum(ray_specdec_requests_running{SELECTOR})", "running"),
               (f"sum(ray_specdec_requests_waiting{SELECTOR})", "waiting")]),
    ]


def latency() -> list:
    return [
        panel("timeseries", "Time to first token",
              "From a request's arrival at the engine to its first token (prefill and the first verify step).",
              "s", p50_p99("ray_specdec_time_to_first_token_seconds")),
        panel("timeseries", "Inter-token latency",
              "Time between a request's verify steps, divided over the tokens each step committed: what a "
              "streaming client sees per token. Speculation lowers it by committing several tokens per step.",
              "s", p50_p99("ray_specdec_inter_token_latency_seconds")),
        panel("timeseries", "Draft vs verify latency",
              "One drafting call (K draft forwards and the round trip) against one verify forward of the target "
              "over all its shards. Drafting should cost a small fraction of verifying; with pipelining, a used "
              "pre-drafted block costs no wait.",
              "s", p50_p99("ray_specdec_draft_latency_seconds", "draft ")
              + p50_p99("ray_specdec_verify_latency_seconds", "verify ")),
        panel("timeseries", "Request latency",
              "From a request's arrival at the engine to its last token, for requests that finished (stop or "
              "length).",
              "s", p50_p99("ray_specdec_request_latency_seconds")),
    ]


def memory() -> list:
    return [
        panel("timeseries", "Prefix cache hit rate",
              "Share of prompt tokens whose KV the prefix cache served (copied from an earlier or running "
              "request's, not computed): the turns of a conversation and a shared system prompt hit. vLLM's "
              "prefix_cache_hits / prefix_cache_queries.",
              "percentunit",
              [(f"{rate('ray_specdec_prefix_cache_hits_total')} / {rate('ray_specdec_prefix_cache_queries_total')}",
                "hit rate")]),
        panel("timeseries", "Prompt tokens: computed and cached",
              "Prompt tokens per second, split into those the prefix cache served and those prefilled.",
              "short",
              [(rate("ray_specdec_prefix_cache_hits_total"), "cached"),
               (f"{rate('ray_specdec_prefix_cache_queries_total')} - {rate('ray_specdec_prefix_cache_hits_total')}",
                "computed")]),
        panel("timeseries", "KV budget in use and evictions",
              "The KV budget (kv_cache_memory) in use: running requests' reservations plus cached prefixes; at "
              "1.0 new requests wait. Evictions: cached prefixes dropped (least recently used first) for room.",
              "short",
              [(f"max by (model_name, replica) (ray_specdec_kv_cache_usage{SELECTOR})", "in use {{replica}}"),
               (rate("ray_specdec_prefix_cache_evictions_total"), "evictions/s")]),
    ]


def internals() -> list:
    return [
        panel("timeseries", "KV-cache rewinds",
              "Rewinds that dropped tokens, per second, and the tokens they dropped, for the draft's and the "
              "target's caches. The target drops the rejected draft tokens of each step; the draft drops those and "
              "any unused pre-drafted block.",
              "short",
              [(rate("ray_specdec_kv_rewinds_total", "role"), "rewinds {{role}}"),
               (rate("ray_specdec_kv_rewound_tokens_total", "role"), "rewound tokens {{role}}")]),
        panel("timeseries", "KV-cache tokens and K",
              "Tokens held in the KV caches of the requests in flight (per role) and K, the number of draft tokens "
              "the last step asked for (it moves with num_speculative_tokens 'auto'; 0 while no request runs).",
              "short",
              [(f"sum by (role) (ray_specdec_kv_cache_tokens{SELECTOR})", "cache tokens {{role}}"),
               (f"max by (model_name) (ray_specdec_num_speculative_tokens{SELECTOR})", "K {{model_name}}")]),
        panel("timeseries", "Pipeline hit rate",
              "Separate, pipelined draft: share of pre-drafted blocks used as the next proposal (the whole block "
              "was accepted and the bonus token matched the draft's guess). A miss costs only the draft's idle "
              "time.",
              "percentunit",
              [(f"{rate('ray_specdec_pipeline_hits_total')} / ({rate('ray_specdec_pipeline_hits_total')} + "
                f"{rate('ray_specdec_pipeline_misses_total')})", "hit rate")]),
        panel("stat", "Draft failures",
              "Draft calls that failed in the selected time range; the requests went on target-only (same "
              "output, no speed-up) and Ray restarts the draft worker.",
              "short",
              [(f"sum(increase(ray_specdec_draft_failures_total{SELECTOR}[$__range]))", "draft failures")]),
        panel("timeseries", "Finish reasons",
              "Requests finished per second by reason: stop (EOS or a stop string), length (max_tokens or the "
              "context), cancelled (client gone), timeout (--request-timeout), error (a failed shard).",
              "reqps",
              [(rate("ray_specdec_requests_total", "finish_reason"), "{{finish_reason}}")]),
    ]


def engine_table():
    """specdec_engine_info as a table: one row per engine, its labels as columns (an instant query)."""
    target = (query(f"max by ({', '.join(ENGINE_LABELS)}) (ray_specdec_engine_info{SELECTOR})", "")
              .instant().format(PromQueryFormat.TABLE))
    hidden = DataTransformerConfig(id_val="organize", options={"excludeByName": {"Time": True, "Value": True},
                                                               "indexByName": {n: i for i, n in
                                                                               enumerate(ENGINE_LABELS)}})
    return (table.Panel().title("Engine: kernels and CPU")
            .description("How each engine runs: the target's precision and linear kernel, the draft model's "
                         "precision ('none': "
                         "no draft model, or one run as loaded), and the CPU model and widest vector ISA (amx, "
                         "avx512, avx2) of its node. Kernel and precision choices that win on one CPU lose on "
                         "another: read the speed and latency panels with this table.")
            .datasource(DATASOURCE).span(24).height(5).with_target(target).with_transformation(hidden))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}")
