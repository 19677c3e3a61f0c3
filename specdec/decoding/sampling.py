"""Turning logits into the distribution a request samples from, and drawing from it reproducibly.

Warping follows Hugging Face `generate()` exactly (it uses the same warpers, in the same order:
temperature, then top-k, then top-p), so "the target distribution" here is the one HF samples from.
Speculative sampling applies the same warping to the target's p and the draft's q.

**Counter-based randomness.** Every random number a request uses is a pure function of
(its seed, the absolute position of the token it decides, the purpose), never of how many numbers
were drawn before: nothing depends on K, batch-mates, the step's token budget, pipelining, placement
(in-process or Ray, which shard) or device. A 64-bit key is hashed from the triple (`counter_key`,
BLAKE2b); a scalar uniform comes from the key's bits; a vocabulary-wide noise vector comes from
SplitMix64 (the generator of Java's `SplittableRandom`, Steele et al. 2014) run from the key over
the token ids, in exact int64 arithmetic, so every device computes the same bits. Unseeded requests
get a random seed when they are admitted (`make_concrete`), and use it the same way.

**Two ways to sample** (`SamplingParams.speculative_sampling`):
- `invariant`: the token at position t is argmax over the vocabulary of (warped logits + G_t), with
  Gumbel noise G_t from (seed, t) (Gumbel-max: exactly a draw from the warped p). The draft
  proposes argmax(warped q + G_t) with the same noise, and the target accepts a draft token while
  it equals its own choice (Daliri, Musco, Suresh, arXiv 2408.07978). Target-only decoding uses the
  same rule, so a seeded request's text does not depend on the draft, K, or speculation at all.
- `residual`: speculative sampling (Leviathan et al., Chen et al.): the draft samples from q, the
  target accepts with probability min(1, p/q) and resamples from normalize(max(0, p - q)). Most
  acceptance; its seeded text depends on the draft and on the K each step used (so a seeded
  request's K follows its own history alone: `Scheduler._pin`).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

import torch

from specdec.config import SamplingParams
from specdec.decoding.logits_processing import process

#: What a random number decides; each (seed, purpose, position) is used at most once.
PURPOSES = ("draft", "accept", "resample", "noise")

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


# SplitMix64's constants, as int64 (torch has no uint64 arithmetic).
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def make_concrete(sampling: SamplingParams, default_mode: str, prompt_length: int = 0,
                  eos_token_ids: Sequence[int] = ()) -> SamplingParams:
    """A request's parameters as the engine runs them: where its prompt ends, the model's
    end-of-sequence ids and, sampled, a seed (fresh entropy when it has none) and its sampling mode
    (the engine's default when it named none)."""
    sampling = sampling.replace(prompt_length=prompt_length, eos_token_ids=tuple(sorted(eos_token_ids)))
    if sampling.greedy:
        return sampling
    return sampling.replace(seed=sampling.seed if sampling.seed is not None else secrets.randbits(63),
                            speculative_sampling=sampling.speculative_sampling or default_mode)


def counter_key(seed: int, purpose: str, position: int) -> int:
    """The 64-bit key of one random decision: a hash of (seed, purpose, absolute position)."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown random purpose {purpose!r}")
    digest = hashlib.blake2b(f"{seed}:{purpose}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def uniform(seed: int, purpose: str, position: int) -> float:
    """A uniform number in (0, 1) for one decision (53 bits)."""
    return ((counter_key(seed, purpose, position) >> 11) + 0.5) * 2.0**-53


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def gumbel_noise(seed: int, position: int, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise for `token_ids` (`[n]` int64, any device) at one position: `[n]` float64.

    Token v's noise is SplitMix64's (v+1)-th output from the position's key, so any subset of the
    vocabulary (a top-k support, a draft's reduced vocabulary) gets the same numbers the full one would."""
    key = torch.tensor(_signed(counter_key(seed, "noise", position)), dtype=torch.int64, device=token_ids.device)
    z = key + (token_ids + 1) * _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    u = (_shift_right(z, 11).double() + 0.5) * 2.0**-53  # (0, 1)
    return -torch.log(-torch.log(u))


#: Below this share of finite scores, Gumbel noise is drawn for the support only (top-k, top-p).
_SPARSE_SUPPORT = 0.125


def defers_sync(device: torch.device) -> bool:
    """Whether chosen tokens stay on `device` until one host sync reads a batch of them: off the CPU,
    where each read of a single token would stall the device; on the CPU reads cost nothing."""
    return torch.device(device).type != "cpu"


def gumbel_argmax(scores: torch.Tensor, seed: int, position: int, on_device: bool = False) -> int | torch.Tensor:
    """argmax(scores + G) for one position's warped scores `[vocab]` (-inf outside the support):
    a draw from softmax(scores). `on_device`: a 0-d tensor, with no host sync (the noise over the
    whole vocabulary: the same token, since each token's noise depends on its id alone); else an int,
    with the noise drawn for a small support only (cheaper on a CPU, where syncs cost nothing)."""
    if on_device:
        ids = torch.arange(scores.numel(), device=scores.device)
        return (scores.double() + gumbel_noise(seed, position, ids)).argmax()
    support = torch.isfinite(scores)
    count = int(support.sum())
    if count == 1:
        index = int(support.nonzero()[0, 0])
    elif count < _SPARSE_SUPPORT * scores.numel():
        ids = support.nonzero().squeeze(-1)
        index = int(ids[(scores[ids].double() + gumbel_noise(seed, position, ids)).argmax()])
    else:
        ids = torch.arange(scores.numel(), device=scores.device)
        index = int((scores.double() + gumbel_noise(seed, position, ids)).argmax())
    return index


def draw(probs: torch.Tensor, u: float, on_device: bool = False) -> int | torch.Tensor:
    """Inverse-CDF draw from one position's probabilities `[vocab]` with a uniform `u` in (0, 1)
    (`on_device`: a 0-d tensor, with no host sync)."""
    cdf = torch.cumsum(probs.double(), 0)
    index = torch.searchsorted(cdf, cdf[-1:] * u, right=True)[0].clamp(max=probs.numel() - 1)
    return index if on_device else int(index)


#: Top-p looks at this many of the most likely tokens first (more, 4x at a time, if they hold less than top_p).
_TOP_P_FIRST = 64


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to `[num_positions, vocab]` logits (masked entries -> -inf).

    Hugging Face `generate()`'s warpers, in its order (temperature, top-k, top-p) and with its rules:
    top-k keeps every token tied with the k-th; top-p keeps the most likely tokens until the mass
    of the ones before reaches top_p (at least one). Temperature and top-k are HF's own code. Top-p
    is computed over the most likely tokens only (`_top_p_mask`), not by sorting the whole
    vocabulary: on a 152k vocabulary that sort costs ~7 ms per position on this CPU (~30 ms per
    6-row verify). The kept set is HF's except where a token's preceding mass is within float32
    rounding of top_p (HF sums 152k ascending terms; this sums the few largest, descending)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper

    if params.greedy:
        raise ValueError("warp_logits is for sampling; greedy decoding uses argmax")
    scores = logits
    if params.temperature != 1.0:
        scores = TemperatureLogitsWarper(params.temperature)(None, scores)
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = scores.masked_fill(~_top_p_mask(scores, params.top_p), -float("inf"))
    return scores


def _top_p_mask(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """`[n, vocab]` bool: the tokens top-p keeps (the smallest most-likely set whose mass before each
    kept token is < top_p), found among the m most likely tokens, m growing until they hold top_p."""
    probs = torch.softmax(scores, dim=-1)
    vocab = scores.shape[-1]
    m = min(vocab, _TOP_P_FIRST)
    while True:
        top, index = probs.topk(m, dim=-1)  # [n, m] descending
        before = top.cumsum(-1) - top  # mass of the more likely tokens
        if m == vocab or bool((before[:, -1] + top[:, -1] >= top_p).all()):
            break
        m = min(vocab, 4 * m)
    keep = before < top_p
    keep[:, 0] = True
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, index, keep)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`[num_positions, vocab]` logits -> the warped sampling distribution, same shape."""
    return torch.softmax(warp_logits(logits, params), dim=-1)


def choose(logits: torch.Tensor, sampling: SamplingParams, position: int, purpose: str = "draft",
           prefix: Sequence[int] = (), on_device: bool = False) -> tuple[int | torch.Tensor, torch.Tensor | None]:
    """One token from one position's logits `[1, vocab]` the way the request samples: argmax
    (greedy), Gumbel-max with the position's noise (invariant), or an inverse-CDF draw with the
    (purpose, position) uniform (residual), after the request's logits processing from `prefix`
    (the tokens before the position; only read when the request processes logits). Returns the
    column and, for residual, the `[vocab]` distribution it was drawn from (verification needs q).
    `on_device`: the column as a 0-d tensor on the logits' device, read later with the batch's other
    rows in one host sync (`ModelProposer.propose_batch` on a GPU); the same column either way."""
    logits = process(logits, sampling, prefix)
    if sampling.greedy:
        index = logits[0].argmax()
        return (index if on_device else int(index)), None
    if sampling.speculative_sampling == "invariant":
        return gumbel_argmax(warp_logits(logits, sampling)[0], sampling.seed, position, on_device), None
    probs = logits_to_probs(logits, sampling)[0]
    return draw(probs, uniform(sampling.seed, purpose, position), on_device), probs

