"""monitoring/: the checked-in dashboard is its builder's output, every query parses (promtool) and
reads only metrics `actors/metrics.py` defines, every metric is on a panel, and the Prometheus
config and Grafana provisioning files are valid. Whether the queries return data against a live
service: tests/deployments/test_cli_serve.py."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from actors.metrics import METRICS

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "monitoring" / "grafana"


def _builder():
    spec = importlib.util.spec_from_file_location("specdec_dashboard", GRAFANA / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads((GRAFANA / "specdec.json").read_text())


def _targets(dashboard: dict):
    return [(p, t) for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


def _promtool():
    path = shutil.which("promtool")
    assert path, "promtool not found: install Prometheus as the README says (apt-get install -y prometheus)"
    return path


def test_checked_in_dashboard_is_the_builders_output():
    assert (GRAFANA / "specdec.json").read_text() == _builder().render(), \
        "monitoring/grafana/specdec.json is stale: run python monitoring/grafana/dashboard.py"


def test_every_panel_explains_itself_and_uses_the_datasource_variable(dashboard):
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    for p in panels:
        assert p["targets"] and len(p["description"]) > 40, p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    names = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(names) == {"datasource", "model", "replica"}
    assert names["model"]["includeAll"] and names["replica"]["includeAll"]


def test_queries_read_only_defined_metrics_and_every_metric_is_shown(dashboard):
    used = set()
    for panel, target in _targets(dashboard):
        for name in re.findall(r"ray_(specdec_[a-z_]+)", target["expr"]):
            base = re.sub(r"_(total|bucket)$", "", name)
            assert base in METRICS, f"{panel['title']}: {name} is not defined in actors/metrics.py"
            kind = METRICS[base].kind
            suffix = name[len(base):]
            assert suffix == {"counter": "_total", "gauge": "", "histogram": "_bucket"}[kind], name
            used.add(base)
    assert used == set(METRICS), f"metrics on no panel: {sorted(set(METRICS) - used)}"


def test_every_query_parses(dashboard, tmp_path):
    """promtool parses each expression as a recording rule (Grafana's variables as Grafana sends them)."""
    rules = [{"record": f"specdec:panel_{i}", "expr": t["expr"].replace("$model", ".*").replace("$replica", ".*")
              .replace("$__rate_interval", "1m").replace("$__range", "1h")}
             for i, (_, t) in enumerate(_targets(dashboard))]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "specdec-dashboard", "rules": rules}]}))
    result = subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(rules)} rules found" in result.stdout


def test_a_broken_query_fails_the_parse_check(tmp_path):
    """The negative control of the check above."""
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"record": "specdec:broken", "expr": "sum(rate(ray_specdec_num_drafts_total[5m])"}]}]}))
    assert subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True).returncode != 0


def test_prometheus_config_is_valid_and_scrapes_the_default_metrics_port():
    path = ROOT / "monitoring" / "prometheus.yml"
    result = subprocess.run([_promtool(), "check", "config", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load(path.read_text())
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["127.0.0.1:8080"]
    assert "prom_metrics_service_discovery.json" in path.read_text()  # the cluster job, commented


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard():
    provisioning = GRAFANA / "provisioning"
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://127.0.0.1:9090"
    provider = yaml.safe_load((provisioning / "dashboards" / "specdec.yml").read_text())["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"]
