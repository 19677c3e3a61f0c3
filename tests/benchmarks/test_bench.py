"""`specdec bench` end to end on tiny models: every output is written and holds sane values."""

import json

import pytest

from benchmarks.runner import BenchConfig
from specdec.cli import main


def test_bench_smoke(tiny_llama, tiny_llama_draft, tmp_path, ray_session, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"w5 w6 w7 w8 w9 w10"\n{"id": "second", "prompt": "w3 w1 w2 w3 w1 w2 w3"}\n')
    out = tmp_path / "out"
    code = main(["bench", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft), "--prompts", str(prompts),
                 "--limit", "2", "--max-tokens", "16", "--k-sweep", "1,3", "--max-speculative-tokens", "4", "--ray-tp", "1",
                 "--out", str(out)])
    assert code == 0
    data = json.loads((out / "bench.json").read_text())
    rows = {r["method"]: r for r in data["summary"]}
    expected = {"hf", "hf-assisted", "hf-prompt-lookup", "specdec-none", "specdec-k1", "specdec-k3", "specdec-auto",
                "specdec-ngram", "ray-tp1-colocated", "ray-tp1-separate", "ray-tp1-separate-pipeline"}
    assert expected <= set(rows)
    assert rows["hf"]["speedup"] == 1.0
    for name, row in rows.items():
        assert row["prompts"] == 2 and row["tokens"] > 0 and row["tokens_per_second"] > 0, name
        assert row["identical_to_baseline"] == 2, name  # greedy: every method's tokens equal the baseline's
    for name in ("specdec-k1", "specdec-k3", "specdec-auto", "ray-tp1-colocated", "ray-tp1-separate",
                 "ray-tp1-separate-pipeline"):
        row = rows[name]
        assert 0 <= row["acceptance_rate"] <= 1
        assert row["mean_accepted_length"] >= 1
        assert 0 < row["target_forwards_per_token"] <= 1
        assert row["cost_ratio_c"] > 0 and row["theoretical_speedup"] > 0 and row["efficiency"] > 0
    assert rows["specdec-k3"]["mean_k"] <= 3 and len(rows["specdec-k3"]["acceptance_by_position"]) == 3
    for name in ("ray-tp1-colocated", "ray-tp1-separate", "ray-tp1-separate-pipeline"):
        assert rows[name]["vs_in_process"] > 0, name
    markdown = (out / "bench.md").read_text()
    assert "| specdec-k3 |" in markdown and "speedup" in markdown
    for png in ("speedup.png", "acceptance_by_position.png", "speedup_vs_k.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "specdec bench" in capsys.readouterr().out


def test_bench_rejects_bad_input(tmp_path, capsys):
    assert main(["bench", "--prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(["bench", "--prompts", str(bad)]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert main(["bench", "--limit", "0"]) == 2
    assert main(["bench", "--prompts", str(bad), "--ray-placement", "nearby"]) == 2
    assert "draft placements" in capsys.readouterr().err


def test_bench_concurrency_smoke(tiny_llama, tiny_llama_draft, tmp_path, ray_session, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(f'"w{i} w{i + 1} w{i + 2} w3 w1 w2 w3 w1"' for i in range(4, 10)) + "\n")
    out = tmp_path / "out"
    code = main(["bench", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft), "--prompts", str(prompts),
                 "--max-tokens", "12", "--max-speculative-tokens", "4", "--concurrency", "1,3", "--out", str(out)])
    assert code == 0
    rows = json.loads((out / "bench-concurrency.json").read_text())["summary"]
    by = {(r["method"], r["concurrency"]): r for r in rows}
    assert set(by) == {(m, n) for m in ("hf-static", "specdec-batched", "specdec-unbatched", "ray") for n in (1, 3)}
    for (method, n), row in by.items():
        assert row["requests"] == 6 and row["tokens"] > 0 and row["tokens_per_second"] > 0, (method, n)
        assert row["latency_p50"] <= row["latency_p99"]
        if method != "hf-static":
            # Greedy: every request equals target-only generate() of its prompt alone.
            assert row["identical_to_target_only"] == 6, (method, n)
            assert 0 <= row["acceptance_rate"] <= 1
    assert by[("specdec-batched", 3)]["mean_batch"] > 1 and by[("specdec-unbatched", 3)]["mean_batch"] == 1
    assert by[("ray", 3)]["mean_batch"] > 1
    assert (out / "throughput_vs_concurrency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| specdec-batched | 3 |" in capsys.readouterr().out
    assert main(["bench", "--concurrency", "0"]) == 2


def test_bench_levers(tiny_llama, tiny_llama_draft, tmp_path, monkeypatch):
    """Each draft lever is a row on the same prompts; the random-init draft is paired with target-only."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"w5 w6 w7 w8 w5 w6 w7 w8"\n"w3 w1 w2 w3 w1 w2 w3"\n')
    out = tmp_path / "out"
    assert main(["bench", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft), "--prompts", str(prompts),
                 "--max-tokens", "16", "--k-sweep", "", "--no-ray", "--no-prompt-lookup", "--no-ngram",
                 "--precisions", "none,int8-weight", "--draft-vocabs", "40", "--prompt-lookup-mins", "3", "--hopeless", "1",
                 "--out", str(out)]) == 0
    data = json.loads((out / "bench.json").read_text())
    rows = {r["method"]: r for r in data["summary"]}
    assert data["meta"]["draft_calibration"]  # auto measured its candidates
    levers = [name for name in rows if name.startswith("specdec-auto (")]
    assert {"specdec-auto (draft none)", "specdec-auto (draft int8-weight)"} <= set(levers)
    assert any("vocab" in name for name in levers) and any("n-gram 3+ first" in name for name in levers)
    hopeless = [name for name in rows if "random-init" in name]
    assert len(hopeless) == 2 and all(rows[name]["prompts"] == 1 for name in hopeless)
    paired = next(name for name in hopeless if name.startswith("specdec-auto"))
    assert rows[paired]["vs_in_process"] > 0
    for name, row in rows.items():
        assert row["identical_to_baseline"] == row["prompts"], name  # greedy: same tokens as HF target-only
    with pytest.raises(ValueError, match="--precisions"):
        BenchConfig(target="t", draft="d", prompts=("x",), prompts_source="-", precisions=("int4",))
