"""The measurement tools behind the README's Guarantees figures run, and on float32 tiny models
report what the test suite asserts elsewhere: no divergence."""

from __future__ import annotations

import json

from benchmarks import greedy_divergence, seeded_stability


def test_greedy_divergence_smoke(tmp_path):
    out = tmp_path / "greedy.json"
    greedy_divergence.main(["--prompts", "4", "--tokens", "12", "--dtypes", "float32", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = result["runs"]["float32"]
    assert [r["comparison"] for r in rows] == ["hf_batch4_vs_hf_alone", "specdec_alone_vs_hf_alone",
                                               "specdec_batched_vs_hf_alone"]
    assert all(r["prompts"] == 4 and r["diverged"] == 0 for r in rows), rows
    assert result["cpu"]["model"]


def test_seeded_stability_smoke(tmp_path):
    out = tmp_path / "seeded.json"
    seeded_stability.main(["--prompts", "4", "--tokens", "12", "--precisions", "none", "--out", str(out)])
    rows = json.loads(out.read_text())["runs"]["none"]
    assert len(rows) == 5 and all(r["prompts"] == 4 and r["diverged"] == 0 for r in rows), rows
