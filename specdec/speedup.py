"""The expected gain of speculation (Leviathan et al., arXiv 2211.17192, section 3.5): how many tokens
a step with K proposals emits at acceptance rate a, and the walltime improvement at cost ratio c.

At the bottom of the core, beside `config.py`: the draft's precision is chosen by it at load time
(`specdec.kernels.draft_precision`), and K while decoding (`specdec.decoding.speculation_length`).
"""

from __future__ import annotations


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per step with K proposals at i.i.d. acceptance rate alpha."""
    if alpha >= 1.0 - 1e-9:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def theoretical_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan's expected walltime improvement (1 - a^(K+1)) / ((1 - a)(cK + 1))."""
    return expected_tokens(alpha, k) / (c * k + 1.0)
