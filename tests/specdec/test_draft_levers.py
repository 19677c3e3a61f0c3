"""The draft levers: precisions, a frequency-ranked draft vocabulary (FR-Spec), prompt lookup in
front of the draft model, and `auto` precision chosen by measurement.

None may change the output: greedy output equals Hugging Face `generate()` token for token for each
of them, and a draft restricted to part of the vocabulary keeps sampling exact (q renormalized over
the kept tokens), by the chi-square test of `test_lossless_sampling.py`, with its negative control
(q left unrenormalized while proposals are drawn from the kept tokens only)."""

import pytest
import torch

import specdec.models.draft_vocab
import specdec.decoding.proposers.model
import specdec.decoding.sampling
from specdec import SamplingParams, SpeculativeEngine
from specdec.kernels.draft_precision import (Measurement, candidates_here, choose_precision, expected_speedup,
                                     pick, prepare_draft)
from specdec.models.draft_vocab import ReducedVocabHead, draft_token_ids
from specdec.models.loading import load_model
from tests.distribution import chi_square_pvalue, exact_pair_distribution, sample_pair
from tests.specdec.test_lossless_sampling import T1, assert_exercises_both_paths

PROMPTS = [[5, 6, 7, 8, 9], [3], [10, 20, 30, 10, 20, 30, 10, 20]]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def references(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in PROMPTS]


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("settings", [
    pytest.param({"draft_precision": "none"}, id="none"),
    pytest.param({"draft_precision": "float32"}, id="float32"),
    pytest.param({"draft_precision": "bfloat16"}, id="bfloat16"),
    pytest.param({"draft_precision": "int8"}, id="int8"),
    pytest.param({"draft_precision": "int8-weight"}, id="int8-weight"),
    pytest.param({"draft_precision": "auto"}, id="auto"),
    pytest.param({"draft_precision": "bfloat16", "draft_vocab_size": 40}, id="bfloat16-vocab40"),
    pytest.param({"draft_precision": "none", "prompt_lookup_min": 2}, id="ngram-first"),
])
@pytest.mark.parametrize("k", [2, 5])
def test_greedy_equals_hf_generate_for_every_lever(tiny_llama, tiny_llama_draft, references, private_cache,
                                                   settings, k):
    engine = SpeculativeEngine.from_pretrained(str(tiny_llama), draft=str(tiny_llama_draft),
                                               num_speculative_tokens=k, **settings)
    expected_precision = settings["draft_precision"]
    # auto picks one of the candidates this CPU measures (not one it skips, e.g. bfloat16 without native support).
    allowed = candidates_here(engine.draft_device)[0] if expected_precision == "auto" else [expected_precision]
    assert engine.draft_precision in allowed
    proposed = 0
    for prompt, expected in zip(PROMPTS, references):
        out = engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=MAX_TOKENS))
        assert out.token_ids == expected
        proposed += out.speculative.num_draft_tokens
    assert proposed > 0
    if "draft_vocab_size" in settings:
        head = engine.draft_model.model.get_output_embeddings()
        assert isinstance(head, ReducedVocabHead) and engine.draft_vocab_size == head.token_ids.numel() <= 40 + 4


def test_ngram_first_proposes_matches_for_free(tiny_llama, tiny_llama_draft, private_cache):
    engine = SpeculativeEngine.from_pretrained(str(tiny_llama), draft=str(tiny_llama_draft), num_speculative_tokens=2,
                                               draft_precision="none", prompt_lookup_min=3)
    proposer = engine.proposer
    context = [10, 20, 30, 40, 50, 60, 10, 20, 30]
    # A 3-token match: the lookup proposes what followed, up to max_tokens, with no draft forward.
    p = proposer.propose(proposer.new_state(), context, 2, SamplingParams(), max_tokens=5)
    assert p.token_ids == [40, 50, 60, 10, 20] and p.num_forwards == 0 and p.probs is None
    # No match of 3: the model proposes exactly K.
    p = proposer.propose(proposer.new_state(), [1, 2, 3, 4], 2, SamplingParams(), max_tokens=5)
    assert len(p.token_ids) == 2 and p.num_forwards == 2


def test_prepare_draft_leaves_the_loaded_model_untouched(tiny_llama_draft):
    loaded = load_model(str(tiny_llama_draft))
    before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    for precision in ("bfloat16", "int8", "int8-weight"):
        prepared = prepare_draft(loaded.model, precision, torch.tensor([0, 1, 2, 5]))
        assert prepared is not loaded.model
    assert prepare_draft(loaded.model, "none") is loaded.model
    after = loaded.model.state_dict()
    assert type(loaded.model.get_output_embeddings()) is torch.nn.Linear
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_reduced_vocab_head_keeps_only_its_tokens():
    head = torch.nn.Linear(8, 20, bias=True)
    kept = torch.tensor([0, 3, 7, 19])
    reduced = ReducedVocabHead(head, kept, 20)
    hidden = torch.randn(2, 3, 8)
    logits = reduced(hidden)  # [2, 3, 20]
    assert logits.shape == (2, 3, 20)
    torch.testing.assert_close(logits[..., kept], head(hidden)[..., kept])
    outside = torch.ones(20, dtype=torch.bool)
    outside[kept] = False
    assert torch.isneginf(logits[..., outside]).all()
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))  # renormalized over the kept tokens


def test_draft_vocabulary_ranks_by_frequency_and_keeps_special_tokens(private_cache):
    from tests.tiny_models import make_tokenizer

    tok = make_tokenizer(50)
    ids = draft_token_ids(tok, 50, 5)
    assert 0 in ids.tolist()  # <eos>, a special token
    assert len(ids) <= 6 and ids.tolist() == sorted(ids.tolist())
    ranking = specdec.models.draft_vocab.frequency_ranking(tok, 50)
    assert sorted(ranking) == list(range(50))
    assert list(private_cache.glob("vocab/*.json"))  # computed once, then read from the cache
    with pytest.raises(ValueError, match="draft vocabulary size"):
        draft_token_ids(tok, 50, 0)


def test_auto_precision_measures_against_the_target_and_caches_the_decision(tiny_llama, tiny_llama_draft,
                                                                             private_cache, trust_any_machine):
    target, draft = load_model(str(tiny_llama)), load_model(str(tiny_llama_draft))
    chosen, measured, record = choose_precision(draft, target)
    measurable, skipped = candidates_here(draft.device)
    assert chosen in measurable and set(skipped) <= {"bfloat16", "float32"}
    assert {m.precision for m in measured} == set(measurable)
    assert all(0.0 <= m.agreement <= 1.0 and m.seconds > 0 and m.speedup > 0 for m in measured)
    # A perturbed copy of the target agrees with it on most positions of the calibration text.
    assert max(m.agreement for m in measured) > 0.5
    assert record.choice == chosen and record.cached and record.conditions["rounds"] >= 5
    assert pick(measured).precision == chosen and record.conditions["consistent"]
    assert record.cpu["model"] and record.measured_at.startswith("20")
    again, measured_again, cached = choose_precision(draft, target)
    assert (again, measured_again) == (chosen, [])  # from the cache: nothing measured
    assert cached.path == record.path and cached.predicted == record.predicted


def test_auto_never_picks_a_precision_expected_to_lose_to_the_unquantized_draft():
    def m(name, alpha, c):
        speedup, k = expected_speedup(alpha, c)
        return Measurement(name, alpha, alpha, c, c, speedup, k)

    # int8 is cheapest but agrees far less (SmolLM2 as its own draft): bfloat16 wins.
    assert pick([m("none", 0.99, 1.0), m("bfloat16", 0.96, 0.55), m("int8", 0.3, 0.3)]).precision == "bfloat16"
    # Nothing beats the draft as loaded: keep it.
    assert pick([m("none", 0.9, 0.1), m("bfloat16", 0.5, 0.09), m("int8", 0.2, 0.05)]).precision == "none"
    # A near tie goes to the earlier (more faithful) candidate.
    assert pick([m("bfloat16", 0.87, 0.103), m("int8-weight", 0.875, 0.108)]).precision == "bfloat16"
    assert expected_speedup(0.0, 0.2)[0] < 1 < expected_speedup(0.9, 0.1)[0]


# ----------------------------------------------------------------------- sampling, reduced vocabulary

#: The kept tokens: the draft's favourite after the pattern's 1 (token 2) is left out on purpose, so
#: renormalizing q over the kept tokens matters.
RANKING = [3, 1, 0, 4, 2, 5, 6, 7]
NUM_KEPT = 4


def _run_reduced(pair, monkeypatch):
    from tests.distribution import VOCAB

    monkeypatch.setattr(specdec.models.draft_vocab, "frequency_ranking", lambda tokenizer, vocab_size: RANKING[:VOCAB])
    target, draft = pair
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=2,
                                               draft_precision="none", draft_vocab_size=NUM_KEPT)
    kept = engine.draft_model.model.get_output_embeddings().token_ids
    assert 2 not in kept.tolist()
    exact = exact_pair_distribution(engine.target_model.model, T1, first=0)
    counts, acceptance_rate, _ = sample_pair(engine, T1, 3, 2000, first=0)
    return chi_square_pvalue(counts, exact), acceptance_rate, kept


def test_reduced_vocab_draft_sampling_matches_target(small_vocab_pair, monkeypatch):
    pvalue, acceptance_rate, _ = _run_reduced(small_vocab_pair, monkeypatch)
    assert_exercises_both_paths(acceptance_rate)
    assert pvalue > 1e-3


def test_unrenormalized_draft_q_is_detected(small_vocab_pair, monkeypatch):
    """Negative control: proposals drawn from the kept tokens, but q reported as the draft's full
    softmax (mass outside the kept set), must fail the same test."""
    kept_ids = {}

    def leaky_choose(logits, sampling, position, purpose="draft", prefix=(), on_device=False):
        finite = torch.isfinite(logits)
        leaked = torch.where(finite, logits, logits[finite].min() + 2.0)  # the excluded tokens keep some mass
        q = specdec.decoding.sampling.logits_to_probs(leaked, sampling)[0]
        mask = torch.zeros_like(q)
        mask[kept_ids["ids"]] = 1.0
        restricted = q * mask / (q * mask).sum()  # drawn from the kept tokens, reported as the full q
        u = specdec.decoding.sampling.uniform(sampling.seed, purpose, position)
        return specdec.decoding.sampling.draw(restricted, u, on_device), q

    monkeypatch.setattr(specdec.decoding.proposers.model, "choose", leaky_choose)
    from tests.distribution import VOCAB

    kept_ids["ids"] = torch.tensor(sorted(RANKING[:NUM_KEPT]))[torch.tensor(sorted(RANKING[:NUM_KEPT])) < VOCAB]
    pvalue, _, kept = _run_reduced(small_vocab_pair, monkeypatch)
    assert set(kept.tolist()) >= set(kept_ids["ids"].tolist())
    assert pvalue < 1e-6
