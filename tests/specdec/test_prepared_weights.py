"""Start-up: prepared draft weights cached on disk, the target's tokenizer reused by its draft, and
the start-up stages timed and announced.

The cached draft must be the same model as one prepared from scratch (same logits, bit for bit),
a damaged or foreign entry must be noticed and rebuilt, and the cache holds no pickles."""

import json
import os
import shutil
import subprocess
import time

import pytest
import torch

from specdec import SpeculativeEngine

from specdec.models import model_cache
from specdec.cli import main
from specdec.kernels.draft_precision import prepare_draft
from specdec.models.loading import load_model, same_tokenizer_files

IDS = torch.tensor([[5, 6, 7, 8, 9, 3, 2, 40]])


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def entries(cache):
    return sorted(p for p in (cache / "prepared").iterdir() if not p.name.startswith(".")) \
        if (cache / "prepared").is_dir() else []


@pytest.mark.parametrize("precision,vocab", [("int8-weight", None), ("int8-weight", [0, 1, 2, 5, 9, 40]),
                                             ("bfloat16", None)])
def test_cached_draft_equals_a_fresh_one(tiny_qwen2_draft, private_cache, precision, vocab):
    loaded = load_model(str(tiny_qwen2_draft))
    vocab_ids = torch.tensor(vocab) if vocab else None
    fresh = prepare_draft(loaded.model, precision, vocab_ids)  # no source: computed, not cached
    assert entries(private_cache) == []
    first = prepare_draft(loaded.model, precision, vocab_ids, source=loaded.source)  # computes and caches
    (entry,) = entries(private_cache)
    assert sorted(p.name for p in entry.iterdir()) == ["manifest.json", "model.safetensors"]  # no pickles
    cached = prepare_draft(loaded.model, precision, vocab_ids, source=loaded.source)
    assert any(t.is_meta for t in cached.parameters()) is False
    assert torch.equal(logits(cached), logits(fresh)) and torch.equal(logits(first), logits(fresh))
    assert type(cached.get_output_embeddings()) is type(fresh.get_output_embeddings())


def test_the_key_follows_what_the_weights_depend_on(tiny_qwen2_draft, private_cache):
    loaded = load_model(str(tiny_qwen2_draft))
    prepare_draft(loaded.model, "int8-weight", source=loaded.source)
    prepare_draft(loaded.model, "int8-weight", torch.tensor([0, 1, 2, 5]), source=loaded.source)
    prepare_draft(loaded.model, "bfloat16", source=loaded.source)
    prepare_draft(loaded.model, "int8", source=loaded.source)  # fbgemm packs in memory: nothing to cache
    assert len(entries(private_cache)) == 3


@pytest.mark.parametrize("damage", ["truncated", "manifest size", "foreign key", "other tensors"])
def test_a_damaged_entry_is_detected_and_rebuilt(tiny_qwen2_draft, private_cache, damage, caplog):
    loaded = load_model(str(tiny_qwen2_draft))
    fresh = prepare_draft(loaded.model, "int8-weight")
    prepare_draft(loaded.model, "int8-weight", source=loaded.source)
    (entry,) = entries(private_cache)
    weights, manifest = entry / "model.safetensors", entry / "manifest.json"
    meta = json.loads(manifest.read_text())
    if damage == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "manifest size":
        meta["size"] += 1
    elif damage == "foreign key":
        meta["key"]["precision"] = "bfloat16"
    else:
        from safetensors.torch import save_file

        save_file({"x": torch.zeros(3)}, str(weights))
        meta["size"] = weights.stat().st_size
    if damage != "truncated":
        manifest.write_text(json.dumps(meta))
    rebuilt = prepare_draft(loaded.model, "int8-weight", source=loaded.source)
    assert "unusable" in caplog.text
    assert torch.equal(logits(rebuilt), logits(fresh))
    (entry,) = entries(private_cache)
    assert json.loads((entry / "manifest.json").read_text())["size"] == (entry / "model.safetensors").stat().st_size
    reloaded = prepare_draft(loaded.model, "int8-weight", source=loaded.source)
    assert torch.equal(logits(reloaded), logits(fresh))


def test_an_unwritable_cache_only_costs_the_preparation(tiny_qwen2_draft, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SPECDEC_CACHE", str(blocker))
    loaded = load_model(str(tiny_qwen2_draft))
    draft = prepare_draft(loaded.model, "int8-weight", source=loaded.source)
    assert torch.equal(logits(draft), logits(prepare_draft(loaded.model, "int8-weight")))


def test_models_rm_removes_what_was_prepared_from_the_model(tiny_qwen2_draft, private_cache, capsys):
    name = "qwen2.5-coder-0.5b-instruct"
    directory = model_cache.model_dir(name)
    shutil.copytree(tiny_qwen2_draft, directory)
    loaded = load_model(str(directory))
    prepare_draft(loaded.model, "int8-weight", source=loaded.source)
    other = load_model(str(tiny_qwen2_draft))
    prepare_draft(other.model, "int8-weight", source=other.source)
    assert len(entries(private_cache)) == 2
    assert main(["models", "rm", name]) == 0
    assert not directory.exists()
    (left,) = entries(private_cache)
    assert json.loads((left / "manifest.json").read_text())["key"]["draft"][0] == other.source


def test_the_draft_shares_the_targets_tokenizer_when_its_files_are_identical(tiny_qwen2, tiny_qwen2_draft,
                                                                            tiny_other_vocab):
    target = load_model(str(tiny_qwen2))
    assert same_tokenizer_files(str(tiny_qwen2), str(tiny_qwen2_draft))
    assert load_model(str(tiny_qwen2_draft), tokenizer_of=target).tokenizer is target.tokenizer
    assert not same_tokenizer_files(str(tiny_qwen2), str(tiny_other_vocab))
    assert load_model(str(tiny_other_vocab), tokenizer_of=target).tokenizer is not target.tokenizer


def test_engine_records_and_announces_its_startup_stages(tiny_qwen2, tiny_qwen2_draft, private_cache, caplog):
    caplog.set_level("INFO", logger="specdec.startup")
    started = time.perf_counter()
    engine = SpeculativeEngine.from_pretrained(str(tiny_qwen2), draft=str(tiny_qwen2_draft),
                                               draft_precision="int8-weight")
    elapsed = time.perf_counter() - started
    # The target's linears are prepacked in a thread while its tokenizer loads; the draft reuses that tokenizer.
    assert sorted(engine.startup_seconds) == ["choose target kernel", "load draft", "load target",
                                              "load target tokenizer", "prepare draft", "prepare target"]
    # Each stage's own duration: positive, within the whole load (stages overlap, so no sum).
    assert all(0 < s <= elapsed for s in engine.startup_seconds.values()), (engine.startup_seconds, elapsed)
    lines = [r.getMessage() for r in caplog.records if r.name == "specdec.startup"]
    assert sorted(line.split(" (")[0].split(":")[0] for line in lines) == sorted(engine.startup_seconds)
    assert lines[0] == f"load target ({tiny_qwen2}): {engine.startup_seconds['load target']:.1f}s"
    assert len(entries(private_cache)) == 1  # the prepared draft was cached on the way


def test_cli_prints_a_line_per_startup_stage(tiny_llama, tiny_llama_draft, private_cache):
    def run(*args):
        proc = subprocess.run(["specdec", *args, "generate", "--target", str(tiny_llama), "--draft",
                               str(tiny_llama_draft), "--max-tokens", "4", "--draft-precision", "int8-weight",
                               "w5 w6 w7 w8"], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "SPECDEC_CACHE": str(private_cache)})
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    err = run()
    for name in ("load target (", "load target tokenizer:", "load draft (", "prepare target (", "prepare draft ("):
        assert f"[specdec.startup] {name}" in err
    assert "specdec.startup" not in run("--log-level", "error")
