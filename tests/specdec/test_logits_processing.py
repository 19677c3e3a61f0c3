"""Penalties, logit biases and log-probabilities under speculation, against Hugging Face.

- Greedy with each processor (and all together) equals HF `generate()` with the same processors,
  token for token, alone and batched, with K=4 (accepted, rejected and bonus positions all occur).
- Log-probabilities equal HF's: `compute_transition_scores` of `generate(output_scores=True)`
  (greedy), and a teacher-forced HF forward through HF's processors and warpers (seeded sampling,
  both modes), within 1e-4 in float32, on every emitted token.
- Sampling with penalties follows the processed target distribution (chi-square), and applying a
  row's penalties from the committed prefix only (ignoring the proposed tokens before it) fails.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import specdec.decoding.verify
from specdec import SamplingParams, SpeculativeEngine
from tests.distribution import (BATCH, OpenAIPenalties, chi_square_pvalue, exact_pair_distribution, hf_scores,
                                sample_pair)

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 11, 12, 11, 12], [40, 41, 42], [3, 1, 2, 3, 1, 2, 3, 1]]
TOKENS = 24

PROCESSING = {
    "repetition1.3": dict(repetition_penalty=1.3),
    "presence1.5": dict(presence_penalty=1.5),
    "frequency0.8": dict(frequency_penalty=0.8),
    "bias": dict(logit_bias={7: 4.0, 12: -100.0, 41: 2.5}),
    "all": dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.4, logit_bias={7: 3.0}),
}


@pytest.fixture(scope="module")
def hf_target(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly TOKENS tokens, as ignore_eos
    return model


@pytest.fixture(scope="module")
def engine(tiny_llama, tiny_llama_draft):
    return SpeculativeEngine.from_pretrained(str(tiny_llama), draft=str(tiny_llama_draft), num_speculative_tokens=4)


def _hf_generate(model, prompt, params, **kwargs):
    from transformers import LogitsProcessorList

    custom = ([OpenAIPenalties(params.presence_penalty, params.frequency_penalty, len(prompt))]
              if params.presence_penalty or params.frequency_penalty else [])
    bias = {(int(t),): float(b) for t, b in params.logit_bias} or None
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False, pad_token_id=0,
                              repetition_penalty=params.repetition_penalty, sequence_bias=bias,
                              logits_processor=LogitsProcessorList(custom), **kwargs)


@pytest.mark.parametrize("name", PROCESSING)
def test_greedy_with_processing_equals_hf_generate(engine, hf_target, name):
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, **PROCESSING[name])
    want = [_hf_generate(hf_target, p, params)[0, len(p):].tolist() for p in PROMPTS]
    alone = [engine.generate(prompt_token_ids=p, sampling=params) for p in PROMPTS]
    assert [o.token_ids for o in alone] == want
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        batched = list(pool.map(lambda p: engine.generate(prompt_token_ids=p, sampling=params).token_ids, PROMPTS))
    assert batched == want
    plain = [_hf_generate(hf_target, p, SamplingParams())[0, len(p):].tolist() for p in PROMPTS]
    assert plain != want, "the processing changed nothing: the test would pass without it"
    accepted = sum(o.speculative.num_accepted_tokens for o in alone)
    assert 0 < accepted < sum(o.speculative.num_draft_tokens for o in alone)


def test_greedy_logprobs_equal_hf_transition_scores(engine, hf_target):
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=5, **PROCESSING["all"])
    for prompt in PROMPTS:
        hf = _hf_generate(hf_target, prompt, params, output_scores=True, return_dict_in_generate=True)
        want = hf_target.compute_transition_scores(hf.sequences, hf.scores, normalize_logits=True)[0]
        out = engine.generate(prompt_token_ids=prompt, sampling=params)
        assert out.token_ids == hf.sequences[0, len(prompt):].tolist()
        assert len(out.logprobs) == TOKENS
        assert torch.allclose(torch.tensor([lp.logprob for lp in out.logprobs]), want, atol=1e-4)
        for step, lp in zip(hf.scores, out.logprobs):
            top = torch.log_softmax(step[0].float(), -1).topk(5)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert torch.allclose(torch.tensor([v for _, v in lp.top]), top.values, atol=1e-4)
            assert lp.top[0][1] >= lp.logprob - 1e-6  # greedy: the emitted token is the most likely


def _teacher_forced(model, prompt, output, params):
    """HF's log-probabilities of `output` after `prompt`: one forward over the whole text, each
    position's logits through HF's processors and warpers, log-softmax."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    rows = []
    for t in range(len(output)):
        position = len(prompt) + t
        scores = hf_scores(logits[position - 1 : position], ids[:, :position], params, len(prompt))
        rows.append(torch.log_softmax(scores[0], -1))
    return torch.stack(rows)


@pytest.mark.parametrize("mode", ["invariant", "residual"])
def test_sampled_logprobs_equal_a_teacher_forced_hf_forward(engine, hf_target, mode):
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=TOKENS, ignore_eos=True, logprobs=3,
                            speculative_sampling=mode, **PROCESSING["all"])
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda i: engine.generate(prompt_token_ids=PROMPTS[i], sampling=params.replace(seed=i)),
                             range(len(PROMPTS))))
    for prompt, out in zip(PROMPTS, outs):
        reference = _teacher_forced(hf_target, prompt, out.token_ids, params)
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        want = reference[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)]
        assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-4)
        for row, lp in zip(reference, out.logprobs):
            top = row.topk(3)
            assert torch.allclose(torch.tensor([v for _, v in lp.top]), top.values, atol=1e-4)
    accepted = sum(o.speculative.num_accepted_tokens for o in outs)
    assert 0 < accepted < sum(o.speculative.num_draft_tokens for o in outs)


def test_logprobs_stop_at_the_stop(engine):
    """Tokens cut by a stopping rule inside a block carry no log-probability."""
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    free = engine.generate(prompt_token_ids=PROMPTS[0], sampling=params)
    stopped = engine.generate(prompt_token_ids=PROMPTS[0], sampling=params.replace(max_tokens=7))
    assert len(stopped.logprobs) == len(stopped.token_ids) == 7
    assert [lp.logprob for lp in stopped.logprobs] == pytest.approx([lp.logprob for lp in free.logprobs[:7]], abs=1e-5)
    assert all(lp.top == () for lp in stopped.logprobs)
    assert engine.generate(prompt_token_ids=PROMPTS[0], sampling=params.replace(logprobs=None)).logprobs is None


PENALIZED = SamplingParams(temperature=1.0, repetition_penalty=1.6, presence_penalty=0.7, frequency_penalty=0.3,
                           logit_bias={2: 0.8}, speculative_sampling="residual")


def _from_committed_only(self, j):
    """Bug: every row's penalties counted from the committed prefix, not the proposed tokens before it."""
    if j not in self.rows:
        row = specdec.decoding.verify.process(self.logits[j : j + 1], self.sampling, self.prefix)
        self.rows[j] = specdec.decoding.verify.warp_logits(row, self.sampling)[0]
    return self.rows[j]


@pytest.mark.parametrize("mode, bug", [("residual", False), ("invariant", False), ("residual", True)],
                         ids=["residual", "invariant", "control-penalties-from-committed-prefix"])
def test_penalized_sampling_follows_the_processed_target(small_vocab_pair, monkeypatch, mode, bug):
    target, draft = small_vocab_pair
    params = PENALIZED.replace(speculative_sampling=mode)
    if bug:
        monkeypatch.setattr(specdec.decoding.verify.RowScores, "__call__", _from_committed_only)
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=2,
                                               max_batch_size=BATCH)
    exact = exact_pair_distribution(engine.target_model.model, params, first=1)
    counts, acceptance, _ = sample_pair(engine, params, max_tokens=3, num_samples=2000, first=1)
    pvalue = chi_square_pvalue(counts, exact)
    print(f"{mode} bug={bug}: acceptance {acceptance:.2f}, p-value {pvalue:.2e}")
    assert 0.05 < acceptance < 0.95
    if bug:
        assert pvalue < 1e-3, "the negative control was not detected"
    else:
        assert pvalue > 1e-3


@pytest.mark.parametrize("chunk", [None, 3], ids=["one-prefill", "chunked-prefill"])
def test_prompt_logprobs_equal_a_teacher_forced_hf_forward(tiny_llama, tiny_llama_draft, hf_target, chunk):
    """Every prompt token's log-probability (and top 4) from the prefill equals HF's raw log-softmax at
    the position before it, also when the prompt is prefilled in chunks; the first token has none."""
    extra = {"max_batch_tokens": chunk, "max_batch_size": chunk} if chunk else {}
    engine = SpeculativeEngine.from_pretrained(str(tiny_llama), draft=str(tiny_llama_draft), num_speculative_tokens=4,
                                               **extra)
    prompt = PROMPTS[3] + PROMPTS[0]
    out = engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=4, prompt_logprobs=4,
                                                                         repetition_penalty=1.5))
    with torch.no_grad():
        reference = torch.log_softmax(hf_target(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0].logprob != out.prompt_logprobs[0].logprob  # NaN: nothing predicts it
    for j, (token, entry) in enumerate(zip(prompt[1:], out.prompt_logprobs[1:])):
        assert entry.logprob == pytest.approx(float(reference[j, token]), abs=1e-4)
        top = reference[j].topk(4)
        assert [i for i, _ in entry.top] == top.indices.tolist()
        assert entry.token == engine.tokenizer.decode([token])
    assert engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=4)).prompt_logprobs is None
