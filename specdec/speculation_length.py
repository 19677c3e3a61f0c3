"""How many tokens to propose each step: a fixed K, or K chosen per step from measurements.

`auto` follows Leviathan et al. (arXiv 2211.17192, section 3.5): with per-token acceptance rate a,
a step with K proposals emits on average (1 - a^(K+1)) / (1 - a) tokens and costs
K * draft_forward + target_forward(K+1 tokens) + step overhead. Every term is measured while the
engine runs, not assumed:
- `CostModel` (one per engine, shared by its requests) keeps running estimates of the target's
  forward time for each number of input tokens it has seen (the verify-cost curve; interpolated
  linearly in between), of one draft forward, and of the per-step overhead;
- `AutoK` (one per request) keeps a decayed estimate of a and picks the K in 0..k_max that
  maximises expected tokens per second. K = 0 is plain target decoding: when speculation does not
  pay (a hopeless draft, or a draft nearly as slow as the target), the request falls back to it and
  only probes the draft now and then, with exponentially growing intervals.

With k=auto the K sequence depends on timings, so a seeded *sampled* request is reproducible only
with a fixed k (its distribution is exact either way; greedy output never depends on K).
"""

from __future__ import annotations

from dataclasses import dataclass, field


class FixedK:
    def __init__(self, k: int) -> None:
        self.k = k

    def next_k(self) -> int:
        return self.k

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        pass


@dataclass
class CostModel:
    """Running estimates (exponential moving averages, in seconds) of what a step costs."""

    smoothing: float = 0.3
    target_seconds: dict[int, float] = field(default_factory=dict)  # num input tokens -> one forward
    draft_seconds: float | None = None  # one draft forward of a single token
    overhead_seconds: float = 0.0  # per step, outside the forwards (sampling, verification, bookkeeping)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def observe_target(self, num_tokens: int, seconds: float) -> None:
        self.target_seconds[num_tokens] = self._ema(self.target_seconds.get(num_tokens), seconds)

    def observe_draft(self, num_forwards: int, seconds: float) -> None:
        if num_forwards > 0:
            self.draft_seconds = self._ema(self.draft_seconds, seconds / num_forwards)

    def observe_overhead(self, seconds: float) -> None:
        self.overhead_seconds = self._ema(self.overhead_seconds, max(0.0, seconds))

    def target_cost(self, num_tokens: int) -> float | None:
        """Forward time for `num_tokens` input tokens, interpolated from the sizes seen so far."""
        known = self.target_seconds
        if num_tokens in known:
            return known[num_tokens]
        if not known:
            return None
        sizes = sorted(known)
        if len(sizes) == 1:
            return known[sizes[0]]  # one point: assume flat until measured otherwise
        lower = [n for n in sizes if n < num_tokens]
        upper = [n for n in sizes if n > num_tokens]
        if lower and upper:
            a, b = lower[-1], upper[0]
        elif upper:  # below every measured size
            a, b = sizes[0], sizes[1]
        else:  # above every measured size: extend the last segment
            a, b = sizes[-2], sizes[-1]
        slope = (known[b] - known[a]) / (b - a)
        return max(0.0, known[a] + slope * (num_tokens - a))

    @property
    def cost_ratio(self) -> float | None:
        """c: one draft forward over one target forward (both single-token)."""
        t1 = self.target_cost(1)
        if self.draft_seconds is None or not t1:
            return None
        return self.draft_seconds / t1


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per step with K proposals at i.i.d. acceptance rate alpha."""
    if alpha >= 1.0 - 1e-9:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def theoretical_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan's expected walltime improvement (1 - a^(K+1)) / ((1 - a)(cK + 1))."""
    return expected_tokens(alpha, k) / (c * k + 1.0)


class AutoK:
    """Per-request K policy over an engine-wide `CostModel`."""

    def __init__(
        self,
        costs: CostModel,
        k_max: int,
        k_initial: int = 4,
        prior_alpha: float = 0.6,
        prior_weight: float = 2.0,
        decay: float = 0.9,
        probe_interval: int = 8,
        max_probe_interval: int = 256,
    ) -> None:
        self.costs = costs
        self.k_max = k_max
        self.k_initial = min(k_initial, k_max)
        self.prior_alpha, self.prior_weight, self.decay = prior_alpha, prior_weight, decay
        self.accepted = 0.0  # decayed counts
        self.evaluated = 0.0
        self.probe_interval = self.min_probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.steps_without_draft = 0
        self.last_k = self.k_initial

    @property
    def alpha(self) -> float:
        return (self.accepted + self.prior_alpha * self.prior_weight) / (self.evaluated + self.prior_weight)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:
            return
        # Positions the target judged: the accepted ones plus the first rejected one, if any.
        evaluated = num_accepted + (1 if num_accepted < num_proposed else 0)
        self.accepted = self.decay * self.accepted + num_accepted
        self.evaluated = self.decay * self.evaluated + evaluated

    def rate(self, k: int) -> float | None:
        """Expected tokens per second with K proposals, or None while a cost is unmeasured."""
        target = self.costs.target_cost(k + 1)
        if target is None or (k > 0 and self.costs.draft_seconds is None):
            return None
        seconds = target + k * (self.costs.draft_seconds or 0.0) + self.costs.overhead_seconds
        return expected_tokens(self.alpha, k) / seconds if seconds > 0 else None

    def best_k(self) -> int:
        rates = {k: self.rate(k) for k in range(self.k_max + 1)}
        if rates[0] is None:
            return 0  # measure plain decoding first: it is the baseline every K is weighed against
        if any(r is None for k, r in rates.items() if k == self.k_initial):
            return self.k_initial  # measure the draft
        known = {k: r for k, r in rates.items() if r is not None}
        return max(known, key=lambda k: (known[k], -k))

    def next_k(self) -> int:
        k = self.best_k()
        if k > 0:
            self.probe_interval = self.min_probe_interval
            self.steps_without_draft = 0
        else:
            self.steps_without_draft += 1
            if self.steps_without_draft >= self.probe_interval and self.costs.draft_seconds is not None:
                # Probe: a short proposal refreshes the acceptance estimate; back off while it stays bad.
                self.steps_without_draft = 0
                self.probe_interval = min(2 * self.probe_interval, self.max_probe_interval)
                k = min(2, self.k_max)
        self.last_k = k
        return k
