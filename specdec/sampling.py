"""Turning logits into the distribution a request samples from, and drawing from it reproducibly.

Warping follows Hugging Face `generate()` exactly (it uses the same warpers, in the same order:
temperature, then top-k, then top-p), so "the target distribution" here is the one HF samples from.
Speculative sampling applies the same warping to the target's p and the draft's q.

Randomness always comes in as a `torch.Generator`; a request's seed is split into independent
streams (draft sampling, verification) with `derive_seed`, so in-process and distributed runs that
use the same seed draw the same numbers.
"""

from __future__ import annotations

import hashlib
import secrets

import torch

from specdec.config import SamplingParams


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to `[num_positions, vocab]` logits (masked entries -> -inf)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    if params.greedy:
        raise ValueError("warp_logits is for sampling; greedy decoding uses argmax")
    scores = logits
    if params.temperature != 1.0:
        scores = TemperatureLogitsWarper(params.temperature)(None, scores)
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`[num_positions, vocab]` logits -> the warped sampling distribution, same shape."""
    return torch.softmax(warp_logits(logits, params), dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of `[num_rows, vocab]` probabilities -> `[num_rows]` token ids."""
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def derive_seed(seed: int, stream: str) -> int:
    """An independent 63-bit seed for one named random stream of a request."""
    digest = hashlib.blake2b(f"{seed}:{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def make_generator(seed: int | None, stream: str, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one stream; unseeded requests get fresh entropy."""
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(seed, stream) if seed is not None else secrets.randbits(63))
    return g
