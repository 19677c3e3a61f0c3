"""`specdec serve` as a user runs it, and its metrics in a real Prometheus.

One `specdec serve` subprocess for the module (tiny target, a tiny draft model in its own actor so
pipelining runs, two replicas, a fixed metrics port): it prints the API and metrics URLs once
/health is 200, answers the `openai` client, exports the engine's metrics through Ray's metrics
agent, and shuts everything down on SIGTERM (the module's last test). A real Prometheus (Debian's
`prometheus`, installed as the README says) scrapes it with monitoring/prometheus.yml for the whole
module, and every query of every panel of monitoring/grafana/specdec.json must return data, after
traffic and again 40 s after the last request (the tests between them run during that time).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tests.deployments.processes import free_port, read_line

ROOT = Path(__file__).resolve().parents[2]
SPECDEC = str(Path(sys.executable).with_name("specdec"))  # the console script, as a user runs it
KEY = "secret"
MODEL = "tiny"



def _serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([SPECDEC, "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)



@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    base: str  # the API base URL it printed
    metrics_url: str  # the metrics URL it printed
    last_request: float | None = None  # time.monotonic() when the last request to it ended

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def server(tiny_chat_llama, tiny_chat_llama_draft):
    port, metrics_port = free_port(), free_port()
    proc = _serve("--target", str(tiny_chat_llama), "--draft", str(tiny_chat_llama_draft), "--draft-placement",
                  "separate", "--port", str(port), "--metrics-port", str(metrics_port), "--num-threads", "1",
                  "--api-key", KEY, "--served-model-name", MODEL, "--replicas", "2")
    try:
        base = read_line(proc.stdout, timeout_s=300)
        assert base is not None and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else "slow"
        metrics_url = read_line(proc.stdout, timeout_s=10)
        yield Server(proc, port, base.strip(), (metrics_url or "").strip())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_specdec_serve_prints_its_urls_and_answers_the_openai_client(server):
    assert server.base == f"http://127.0.0.1:{server.port}/v1"
    assert server.metrics_url.startswith("http://127.0.0.1:") and server.metrics_url.endswith("/metrics")
    assert httpx.get(f"http://127.0.0.1:{server.port}/health").status_code == 200
    client = server.client
    assert client.models.list().data[0].model_extra["specdec"]["replicas"] == 2
    outs = [None] * 4

    def run(i):
        outs[i] = client.completions.create(model=MODEL, prompt="w5 w6 w7 w5 w6 w7 w5", max_tokens=16,
                                            temperature=0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len({o.choices[0].text for o in outs}) == 1  # both engines give the same greedy text
    assert all(o.usage.completion_tokens == 16 and "speculative" in o.model_extra for o in outs)


# ------------------------------------------------------------------------------------- metrics

#: Counters whose deltas must equal the sums over the responses (the `speculative` objects, usage).
CHECKED = {"ray_specdec_num_accepted_tokens": "num_accepted_tokens", "ray_specdec_num_draft_tokens":
           "num_draft_tokens", "ray_specdec_num_drafts": "num_drafts", "ray_specdec_generation_tokens": None,
           "ray_specdec_pipeline_hits": "pipeline_hits", "ray_specdec_pipeline_misses": "pipeline_misses"}


def _totals(metrics_url: str) -> dict[str, float]:
    """The checked counters, summed over every series (replicas, Ray's worker labels)."""
    totals = dict.fromkeys(CHECKED, 0.0)
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text):
        if family.name in totals:
            totals[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals


def _stable_totals(metrics_url: str, quiet_s: float = 5.0, timeout_s: float = 60.0) -> dict[str, float]:
    """The totals once they stop moving (workers report every 2 s): the baseline before traffic."""
    last, since, deadline = _totals(metrics_url), time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(1)
        now = _totals(metrics_url)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
    raise AssertionError(f"metrics kept moving with no traffic: {last}")


def _traffic(client: openai.OpenAI) -> dict[str, float]:
    """Greedy and sampled requests, streaming and not, several choices: the expected deltas."""
    expected = dict.fromkeys(CHECKED, 0.0)

    def add(speculative: dict, completion_tokens: int) -> None:
        for metric, field in CHECKED.items():
            expected[metric] += completion_tokens if field is None else speculative[field]

    for temperature, seed in ((0.0, None), (1.0, 7), (1.0, 8)):
        out = client.completions.create(model=MODEL, prompt=["w5 w6 w7 w5 w6 w7 w5", "w9 w10 w11 w9 w10"],
                                        max_tokens=24, temperature=temperature, seed=seed, n=2)
        add(out.model_extra["speculative"], out.usage.completion_tokens)
    # A prompt of over one 16-token block, three times in a row: with two replicas, one of them gets it
    # twice (whichever way the router sends it), and the second copy hits the first one's cached KV.
    for _ in range(3):
        out = client.completions.create(model=MODEL, prompt=" ".join(f"w{3 + i % 40}" for i in range(40)),
                                        max_tokens=8, temperature=0)
        add(out.model_extra["speculative"], out.usage.completion_tokens)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w3 w4 w3 w4"}],
                                            max_tokens=20, temperature=0.8, seed=3, stream=True,
                                            stream_options={"include_usage": True})
    last = None
    for last in stream:
        pass
    add(last.model_extra["speculative"], last.usage.completion_tokens)
    return expected


class Prometheus:
    def __init__(self, tmp_path: Path, metrics_url: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = yaml.safe_load((ROOT / "monitoring" / "prometheus.yml").read_text())
        config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
        job = config["scrape_configs"][0]
        job["static_configs"][0]["targets"] = [metrics_url.removeprefix("http://").removesuffix("/metrics")]
        self.config = tmp_path / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config))
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={self.config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Prometheus answers 503 until its storage is open: wait for /-/ready."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read()
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"Prometheus not ready after {timeout_s}s")

    def query(self, expr: str) -> list:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        assert r.status_code == 200, f"{expr}: HTTP {r.status_code} {r.text[:300]}"
        body = r.json()
        assert body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def wait_for(self, expr: str, want=lambda v: True, timeout_s: float = 60.0) -> float:
        """Poll until `expr` (one sample) satisfies `want`; its value."""
        deadline, value = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            try:
                result = self.query(expr)
            except httpx.HTTPError:
                result = []
            if result:
                value = float(result[0]["value"][1])
                if want(value):
                    return value
            time.sleep(0.5)
        raise AssertionError(f"Prometheus: {expr} is {value} after {timeout_s}s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _promtool_check_metrics(exposition: str) -> tuple[int, str]:
    lint = subprocess.run(["promtool", "check", "metrics"], input=exposition, capture_output=True, text=True)
    return lint.returncode, lint.stdout + lint.stderr


def _ours_with_snake_case_ray_labels(exposition: str) -> str:
    """The specdec families, with the labels Ray adds to every metric (WorkerId, SessionName, ...)
    renamed to snake_case: promtool's lint rejects Ray's camelCase label names on every Ray
    exposition (Ray's own metrics have further lint problems), and everything else must pass."""
    ours = [line for line in exposition.splitlines()
            if line.startswith(("ray_specdec_", "# HELP ray_specdec_", "# TYPE ray_specdec_"))]
    snake = lambda m: m.group(1) + re.sub(r"(?<!^)(?=[A-Z])", "_", m.group(2)).lower() + "="  # noqa: E731
    return "\n".join(re.sub(r"([{,])([A-Z][A-Za-z]*)=", snake, line) for line in ours) + "\n"


def test_promtool_lint_catches_a_bad_metric_name():
    """The negative control of the lint check: a counter without `_total`, an abbreviated unit."""
    rc, problems = _promtool_check_metrics(_ours_with_snake_case_ray_labels(
        '# HELP ray_specdec_latency_ms x\n# TYPE ray_specdec_latency_ms counter\n'
        'ray_specdec_latency_ms{WorkerId="1"} 1\n'))
    assert rc == 3 and "ray_specdec_latency_ms" in problems and "camelCase" not in problems


def _panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def _as_promql(expr: str) -> str:
    """Grafana's variables as Grafana sends them: "All" is the variables' allValue, .*"""
    return (expr.replace("$model", ".*").replace("$replica", ".*")
            .replace("$__rate_interval", "5m").replace("$__range", "5m"))


def _finite(result: list) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in result)


@pytest.fixture(scope="module")
def prometheus_bin():
    missing = [b for b in ("prometheus", "promtool") if shutil.which(b) is None]
    assert not missing, f"{' and '.join(missing)} not found: install Prometheus as the README says " \
                        "(apt-get install -y prometheus)"


@pytest.fixture(scope="module")
def prometheus(server, prometheus_bin, tmp_path_factory):
    """A real Prometheus scraping the server every second, for the rest of the module."""
    prom = Prometheus(tmp_path_factory.mktemp("prometheus"), server.metrics_url)
    try:
        yield prom
    finally:
        prom.stop()


@pytest.fixture(scope="module")
def queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel of the checked-in dashboard."""
    queries = _panel_queries(json.loads((ROOT / "monitoring" / "grafana" / "specdec.json").read_text()))
    assert len(queries) >= 20
    return queries


def _panels_without_data(prom: Prometheus, queries: list[tuple[str, str]]) -> list[str]:
    return [f"{title}: {expr} -> {result}" for title, expr in queries
            if not _finite(result := prom.query(_as_promql(expr)))]


def test_every_dashboard_query_is_live_in_a_real_prometheus(server, prometheus, queries):
    prom = prometheus
    assert subprocess.run(["promtool", "check", "config", str(ROOT / "monitoring" / "prometheus.yml")],
                          capture_output=True).returncode == 0
    assert subprocess.run(["promtool", "check", "config", str(prom.config)], capture_output=True,
                          text=True).returncode == 0
    prom.wait_ready()
    prom.wait_for('up{job="specdec"}', lambda v: v == 1)
    before = _stable_totals(server.metrics_url)
    prom.wait_for("sum(ray_specdec_num_draft_tokens_total)", lambda v: v == before["ray_specdec_num_draft_tokens"])

    # Two waves, each scraped: every rate() window sees the counters and histograms move.
    expected = _traffic(server.client)
    first = before["ray_specdec_num_draft_tokens"] + expected["ray_specdec_num_draft_tokens"]
    prom.wait_for("sum(ray_specdec_num_draft_tokens_total)", lambda v: v == first)
    for metric, value in _traffic(server.client).items():
        expected[metric] += value
    server.last_request = time.monotonic()  # the module's last: the idle test below counts from here
    assert expected["ray_specdec_num_accepted_tokens"] < expected["ray_specdec_num_draft_tokens"]  # rejections
    assert expected["ray_specdec_pipeline_hits"] > 0 and expected["ray_specdec_pipeline_misses"] > 0

    # The counters' deltas are the sums over the responses, on the agent's exposition...
    want = {m: before[m] + expected[m] for m in CHECKED}
    deadline = time.monotonic() + 60
    while (now := _totals(server.metrics_url)) != want and time.monotonic() < deadline:
        time.sleep(1)
    assert now == want
    exposition = httpx.get(server.metrics_url, timeout=10).text
    rc, problems = _promtool_check_metrics(exposition)
    assert rc in (0, 3), problems  # it parses (1: a parse error); 3: lint problems, Ray's own (below)
    rc, problems = _promtool_check_metrics(_ours_with_snake_case_ray_labels(exposition))
    assert rc == 0, problems
    # ... and in Prometheus.
    for metric, value in want.items():
        prom.wait_for(f"sum({metric}_total)", lambda v, value=value: v == value)
    replicas = httpx.get(f"{prom.url}/api/v1/label/replica/values",
                         params={"match[]": "ray_specdec_requests_total"}).json()["data"]
    assert len(replicas) == 2
    assert httpx.get(f"{prom.url}/api/v1/label/model_name/values",
                     params={"match[]": "ray_specdec_requests_total"}).json()["data"] == [MODEL]

    empty = _panels_without_data(prom, queries)
    assert not empty, "panels without data:\n" + "\n".join(empty)

    acceptance = prom.query(_as_promql(queries[0][1]))[0]["value"][1]
    assert 0 < float(acceptance) < 1
    # The repeated long prompt (and the second wave's copies): the prefix cache served some of them.
    prom.wait_for("sum(ray_specdec_prefix_cache_hits_total)", lambda v: v > 0)
    hit_rate = next(expr for title, expr in queries if title == "Prefix cache hit rate")
    assert any(0 < float(r["value"][1]) <= 1 for r in prom.query(_as_promql(hit_rate)))


@pytest.mark.parametrize("args, words", [
    (["--target", "/no/such/model"], "does not exist"),
    (["-k", "0"], "--num-speculative-tokens"),
    (["--tp", "0"], "--tp"),
    (["--port", "70000"], "--port"),
    (["--metrics-port", "0"], "--metrics-port"),
    (["--port", "8000", "--metrics-port", "8000"], "--metrics-port"),
    (["--replicas", "0"], "--replicas"),
    (["--request-timeout-s", "0"], "--request-timeout-s"),
])
def test_specdec_serve_rejects_bad_options_with_exit_2(tiny_chat_llama, args, words, capsys):
    """In process, as the console script runs main() (the test below runs the script itself); each
    fails in validation, before Ray or any model is touched."""
    from specdec.cli import main

    assert main(["serve", "--target", str(tiny_chat_llama), "--draft", "ngram", *args]) == 2
    assert words in capsys.readouterr().err


def test_specdec_serve_refuses_a_metrics_port_in_use(tiny_chat_llama):
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        started = time.monotonic()
        proc = subprocess.run([SPECDEC, "serve", "--target", str(tiny_chat_llama), "--draft", "ngram",
                               "--metrics-port", str(port)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"--metrics-port {port} is not free" in proc.stderr
    assert time.monotonic() - started < 60  # before starting Ray


def test_a_metrics_agent_that_never_answers_fails_the_start_with_a_clear_message():
    from deployments.cli import _wait_metrics

    url = f"http://127.0.0.1:{free_port()}/metrics"  # nothing listens there
    with pytest.raises(RuntimeError, match="Ray's metrics agent is not exporting at " + re.escape(url)):
        _wait_metrics(url, timeout_s=1.5)


#: How long the service stays idle before the second look at the dashboard: Ray's agent dropped a
#: gauge 20 s after it was last set (two of its report intervals, `actors/metrics.py`): after twice
#: that, a gauge set only at request events would be gone.
IDLE_S = 40.0


def test_every_dashboard_query_has_data_40s_after_the_last_request(server, prometheus, queries):
    """The gauges too (requests running and waiting, KV-cache tokens, K, the engine info): each engine
    re-sets them, and they read idle. The tests above ran during the wait."""
    from specdec.kernels.cpu import cpu_info

    assert server.last_request is not None, "test_every_dashboard_query_is_live_in_a_real_prometheus sends traffic"
    time.sleep(max(0.0, server.last_request + IDLE_S - time.monotonic()))
    assert prometheus.query('up{job="specdec"}')[0]["value"][1] == "1"
    empty = _panels_without_data(prometheus, queries)
    assert not empty, f"panels without data after {IDLE_S:.0f}s idle:\n" + "\n".join(empty)

    for gauge in ("ray_specdec_requests_running", "ray_specdec_requests_waiting", "ray_specdec_kv_cache_tokens",
                  "ray_specdec_num_speculative_tokens"):
        series = prometheus.query(f"max by (model_name, replica) ({gauge})")
        assert len(series) == 2 and all(s["value"][1] == "0" for s in series), (gauge, series)
    engines = [s["metric"] for s in prometheus.query("ray_specdec_engine_info == 1")]
    assert len({e["replica"] for e in engines}) == 2, engines
    # Each replica measures its kernel at load; on a busy machine two may choose differently (a
    # measurement made under load is not cached), so /v1/models reports one of the replicas' choices.
    linear_kernel = server.client.models.list().data[0].model_extra["specdec"]["linear_kernel"]
    assert linear_kernel in {e["linear_kernel"] for e in engines}, (linear_kernel, engines)
    for engine in engines:
        assert engine["model_name"] == MODEL and engine["linear_kernel"] in ("torch", "onednn", "hybrid"), engine
        assert engine["cpu"] == cpu_info().model and engine["isa"] == cpu_info().isa, engine
        assert engine.get("draft_precision") not in (None, "None"), engine  # a draft model: its precision


def test_specdec_serve_stops_on_sigterm(server):
    proc = server.proc
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0
    err = proc.stderr.read()
    assert "ready in" in err and "shutting down" in err and server.metrics_url in err
    # Where the start-up went: this process's phases, then the replica's target shard's stages (the
    # draft is a separate actor here: its stages are its own).
    (startup,) = [line for line in err.splitlines() if line.startswith("[specdec serve] start-up: ")]
    for phase in ("imports", "Ray", "Serve", "replicas", "in the replica: its engine's actors started and loaded in",
                  "the target shard's stages: load target", "prepare target", "load target tokenizer"):
        assert phase in startup, startup
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)
