"""`specdec bench` end to end on tiny models: every output is written and holds sane values, and a
phase that cannot fit or fails leaves the rows measured before it written."""

import json

import pytest

from benchmarks import memory
from benchmarks.runner import BenchConfig
from specdec.cli import main
from specdec.models.loading import load_model


def _leave_room_for_one_at_a_time(monkeypatch, target, draft, tp: int, placement: str) -> None:
    """Report just too little free memory for ray-tp{tp}-{placement} beside its in-process pair, and
    enough once the pair is released (the window is the pair's size: the tiny models' ~100 kB)."""
    footprint = memory.Footprint.of(load_model(str(target)).model, load_model(str(draft)).model)
    need = footprint.ray(tp, placement == "separate")
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: need + memory.HEADROOM - 1)
    # Negative control: the plan changes across the window's edges.
    assert memory.plan_ray(need, footprint.pair, True, need + memory.HEADROOM).pairing == "interleaved"
    assert memory.plan_ray(need, footprint.pair, True, need + memory.HEADROOM - 1).pairing == "before/after"
    assert memory.plan_ray(need, footprint.pair, True, need - footprint.pair + memory.HEADROOM - 1).pairing is None


def test_bench_smoke(tiny_llama, tiny_llama_draft, tmp_path, ray_session, capsys, monkeypatch):
    # Both pairings in one run: the colocated phase fits beside its pair (one process fewer), the
    # separate one only with the pair released and reloaded around it.
    _leave_room_for_one_at_a_time(monkeypatch, tiny_llama, tiny_llama_draft, 1, "separate")
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
    assert data["meta"]["ray_pairing"] == {"ray-tp1-colocated": "interleaved", "ray-tp1-separate": "before/after"}
    # The reloaded pair ran both blocks on both prompts (and matched the baseline, checked above).
    assert rows["specdec-auto (pair of ray-tp1-separate)"]["prompts"] == 2
    assert not [name for name in rows if "after" in name]
    assert data["meta"]["skipped"] == [] and data["meta"]["failed"] == [] and not data["meta"]["interrupted"]
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
                 "--target-precisions", "int4", "--out", str(out)]) == 0
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
    int4 = rows["specdec-auto (int4 target)"]  # the int4 target's speculation equals its own target-only run
    assert int4["identical_to_pair"] == int4["prompts"] == 2 and int4["vs_in_process"] > 0
    assert rows["specdec-none (int4 target)"]["prompts"] == 2
    for name, row in rows.items():
        if "int4 target" not in name:  # greedy: same tokens as HF target-only (float32)
            assert row["identical_to_baseline"] == row["prompts"], name
    with pytest.raises(ValueError, match="--target-precisions"):
        BenchConfig(target="t", draft="d", prompts=("x",), prompts_source="-", target_precisions=("float32",))
    with pytest.raises(ValueError, match="--precisions"):
        BenchConfig(target="t", draft="d", prompts=("x",), prompts_source="-", precisions=("int3",))


def _two_prompts(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"w5 w6 w7 w8 w5 w6 w7 w8"\n"w3 w1 w2 w3 w1 w2 w3"\n')
    return prompts


def test_bench_skips_a_ray_phase_that_cannot_fit(tiny_llama, tiny_llama_draft, tmp_path, monkeypatch):
    """A Ray phase whose estimate exceeds the free memory is skipped before any actor starts (no Ray
    here: the test does not start it); the in-process rows are written and the skip is recorded."""
    footprint = memory.Footprint.of(load_model(str(tiny_llama)).model, load_model(str(tiny_llama_draft)).model)
    need = footprint.ray(1, separate=False)  # colocated: the fewest processes
    free = need + memory.HEADROOM - footprint.pair - 1  # too little even with the pair released
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: free)
    out = tmp_path / "out"
    assert main(["bench", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft), "--prompts",
                 str(_two_prompts(tmp_path)), "--max-tokens", "8", "--no-hf", "--k-sweep", "", "--no-ngram",
                 "--ray-tp", "1", "--out", str(out)]) == 0
    data = json.loads((out / "bench.json").read_text())
    rows = {r["method"]: r for r in data["summary"]}
    assert set(rows) == {"specdec-none", "specdec-auto"}  # the in-process phase fitted the same free memory
    assert all(row["prompts"] == 2 for row in rows.values())
    skipped = data["meta"]["skipped"]
    assert [s["phase"] for s in skipped] == ["ray-tp1-colocated", "ray-tp1-separate"]
    assert all(s["reason"].startswith("needs ~") and "available" in s["reason"] for s in skipped)
    assert data["meta"]["ray_pairing"] == {} and data["meta"]["failed"] == []
    assert "**Skipped** ray-tp1-separate: needs ~" in (out / "bench.md").read_text()
    # Negative control: one byte more and the colocated phase would start (its pair released meanwhile).
    assert memory.plan_ray(need, footprint.pair, True, free + 1).pairing == "before/after"


def test_bench_failed_ray_phase_keeps_earlier_rows(tiny_llama, tiny_llama_draft, tmp_path, monkeypatch):
    """A Ray phase that raises (here: the builder, as when the memory monitor kills a shard as it
    loads) is recorded, the next phase still runs, and the rows measured before are written."""
    import actors
    from ray.exceptions import OutOfMemoryError

    calls = []

    def killed(config, address=None):
        calls.append(config.draft_placement)
        raise OutOfMemoryError("Task was killed due to the node running low on memory.\nMemory on the node ...")

    monkeypatch.setattr(actors, "build_ray_engine", killed)
    # Colocated runs interleaved (the pair stays), separate before/after (the pair runs, is released,
    # and its rows are dropped when the Ray engine measured nothing to compare with).
    _leave_room_for_one_at_a_time(monkeypatch, tiny_llama, tiny_llama_draft, 1, "separate")
    out = tmp_path / "out"
    assert main(["bench", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft), "--prompts",
                 str(_two_prompts(tmp_path)), "--max-tokens", "8", "--k-sweep", "1", "--no-ngram",
                 "--no-prompt-lookup", "--ray-tp", "1", "--out", str(out)]) == 0
    assert calls == ["colocated", "separate"]  # the fault happened, twice: the run went on after the first
    data = json.loads((out / "bench.json").read_text())
    rows = {r["method"]: r for r in data["summary"]}
    assert set(rows) == {"hf", "hf-assisted", "specdec-none", "specdec-k1", "specdec-auto"}
    for name, row in rows.items():
        assert row["prompts"] == 2 and row["identical_to_baseline"] == 2, name
    failed = data["meta"]["failed"]
    assert [f["phase"] for f in failed] == ["ray-tp1-colocated", "ray-tp1-separate"]
    assert all(f["error"].startswith("OutOfMemoryError: Task was killed") for f in failed)
    assert data["meta"]["ray_pairing"] == {"ray-tp1-colocated": "interleaved", "ray-tp1-separate": "before/after"}
    markdown = (out / "bench.md").read_text()
    assert "**Failed** ray-tp1-colocated: OutOfMemoryError" in markdown and "| specdec-k1 |" in markdown
    assert (out / "speedup.png").exists()  # the run ended normally: the plots too


def test_bench_interrupted_writes_what_was_measured(tiny_llama, tiny_llama_draft, tmp_path, monkeypatch):
    """Ctrl-C in the middle of the in-process phase: the rows of the prompts measured are written
    before the command exits with 130."""
    from benchmarks.methods import Specdec

    real_run, calls = Specdec.run, []

    def run(self, prompt_token_ids, sampling):
        calls.append(self.name)
        if len(calls) == 5:  # 2 warm-up runs, prompt 0 by both methods, then prompt 1
            raise KeyboardInterrupt
        return real_run(self, prompt_token_ids, sampling)

    monkeypatch.setattr(Specdec, "run", run)
    out = tmp_path / "out"
    assert main(["bench", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft), "--prompts",
                 str(_two_prompts(tmp_path)), "--max-tokens", "8", "--no-hf", "--k-sweep", "", "--no-ngram",
                 "--no-ray", "--out", str(out)]) == 130
    assert len(calls) == 5
    # Nothing else writes bench.json before the phase ends: it exists because of the interrupt.
    data = json.loads((out / "bench.json").read_text())
    assert data["meta"]["interrupted"] is True
    rows = {r["method"]: r for r in data["summary"]}
    assert set(rows) == {"specdec-none", "specdec-auto"} and all(r["prompts"] == 1 for r in rows.values())
    assert "**Interrupted**" in (out / "bench.md").read_text()


@pytest.fixture(scope="module")
def long_bpe_pair(tmp_path_factory, bpe_tokenizer):
    """tiny_bpe_pair's shape with a 4096-token context: the agent workload's prompts reach ~2000 tokens."""
    from pathlib import Path

    from tests.tiny_models import make_model

    template = (Path(__file__).parents[1] / "data" / "qwen2.5-chat-template.jinja").read_text()
    target = make_model(tmp_path_factory.mktemp("conv-target"), "llama", vocab_size=len(bpe_tokenizer), seed=31,
                        tokenizer=bpe_tokenizer, hidden=32, layers=1, heads=2, kv_heads=1,
                        eos_token_id=bpe_tokenizer.eos_token_id, context=4096, chat_template=template)
    draft = make_model(tmp_path_factory.mktemp("conv-draft"), perturb_from=target, noise=0.3, seed=32,
                       tokenizer=bpe_tokenizer, chat_template=template)
    return target, draft


def test_bench_conversations_smoke(long_bpe_pair, tmp_path, capsys):
    target, draft = long_bpe_pair
    out = tmp_path / "out"
    code = main(["bench", "--target", str(target), "--draft", str(draft), "--conversations", "chat,agent,misses",
                 "--num-conversations", "2", "--max-tokens", "6", "--out", str(out)])
    assert code == 0
    data = json.loads((out / "bench-conversations.json").read_text())
    by = {(r["workload"], r["mode"]): r for r in data["summary"]}
    assert set(by) == {(w, m) for w in ("chat", "agent", "misses") for m in ("cache", "no-cache")}
    for (workload, mode), row in by.items():
        turns = 1 if workload == "misses" else 4
        assert row["requests"] == 2 * turns and len(row["ttft_median_by_turn"]) == turns
        assert row["identical_to_other_mode"] == 2 * turns, (workload, mode)  # the cache changes no output
        if mode == "no-cache" or workload == "misses":
            assert row["cached_tokens"] == 0 and row["fresh_ttft_median_by_turn"] == [None] * turns
        else:
            assert row["computed_tokens"] < by[(workload, "no-cache")]["computed_tokens"] / 2
            assert all(x > 0 for x in row["fresh_ttft_median_by_turn"])
    for turn in data["turns"]:
        if turn["mode"] == "cache" and turn["workload"] != "misses" and (turn["turn"] > 1 or turn["conversation"] > 0):
            assert turn["cached_tokens"] > 300, turn  # the shared system prompt at least
    assert data["meta"]["cpu"]["model"]
    assert (out / "ttft_per_turn.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| chat | cache |" in capsys.readouterr().out
    assert main(["bench", "--conversations", "chat,voice"]) == 2
    assert "voice" in capsys.readouterr().err
    assert main(["bench", "--conversations", "chat", "--num-conversations", "0"]) == 2
