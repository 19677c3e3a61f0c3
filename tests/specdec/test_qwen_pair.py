"""The real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft). Slow: pulls ~1.6 GB once and runs
a 1.5B model on the CPU. Run with `python -m pytest -m slow`; prints what it measured."""

import time

import pytest
import torch

from specdec import SamplingParams, SpeculativeEngine
from specdec.config import EngineConfig
from specdec.kernels import stock_linears
from specdec.presets import DEFAULT_DRAFT, DEFAULT_TARGET

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def engines():
    started = time.perf_counter()
    spec = SpeculativeEngine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT, num_speculative_tokens=4)
    print(f"\nload (pull if needed) of the pair: {time.perf_counter() - started:.1f}s")
    plain = SpeculativeEngine(EngineConfig(target=DEFAULT_TARGET, draft="none"), spec.target_model)
    return spec, plain


def test_default_pair_is_lossless_and_accepts_most_tokens(engines):
    spec, plain = engines
    for prompt in PROMPTS:
        ids = spec.tokenize(prompt, chat=True)
        with torch.no_grad(), stock_linears(spec.target_model.model):
            ref = spec.target_model.model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        reference = ref[0, len(ids):].tolist()
        fast = spec.generate(prompt_token_ids=ids, sampling=SamplingParams(max_tokens=MAX_TOKENS))
        slow = plain.generate(prompt_token_ids=ids, sampling=SamplingParams(max_tokens=MAX_TOKENS))
        assert fast.token_ids == reference[: len(fast.token_ids)]
        assert slow.token_ids == fast.token_ids
        s = fast.speculative
        print(f"\n{prompt[:50]!r}: target-only {slow.tokens_per_second:.2f} tok/s, speculative "
              f"{fast.tokens_per_second:.2f} tok/s, acceptance {s.acceptance_rate:.1%}, "
              f"{fast.completion_tokens / s.target_forwards:.2f} tokens/target forward")
        assert s.acceptance_rate > 0.4
