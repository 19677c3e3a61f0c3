"""How many tokens to propose each step: a fixed K, or K chosen per step from measurements.

`auto` follows Leviathan et al. (arXiv 2211.17192, section 3.5): with per-token acceptance rate a,
a step with K proposals emits on average (1 - a^(K+1)) / (1 - a) tokens and costs
K * draft_forward + draft_call (K > 0) + target_forward(K+1 tokens) + step overhead. Every term is measured while the
engine runs, not assumed:
- `CostModel` (one per engine, shared by its requests) keeps windowed estimates of the target's
  forward time for each number of input tokens it has seen (the verify-cost curve; interpolated
  linearly in between), of one draft forward, of the fixed cost of asking the draft at all (a Ray
  round trip when it runs in another actor; ~0 in-process), and of the per-step overhead;
- `AutoK` (one per request) keeps decayed acceptance estimates per proposal position and picks
  the K in 0..speculative_tokens_limit that maximises expected tokens per second. K = 0 is plain target decoding: when speculation does not
  pay (a hopeless draft, or a draft nearly as slow as the target), the request falls back to it and
  only probes the draft now and then, with exponentially growing intervals.

Greedy and `invariant` sampling never depend on K. A `residual`-sampled request's text does (the
draft's proposals decide which numbers are drawn), so a request that names a seed and samples in
residual mode gets a K that depends on nothing but its own history (`HeuristicK` for auto, `FixedK`
otherwise), and the scheduler never trims it for batch-mates.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from specdec.config import AUTO, EngineConfig
from specdec.speedup import expected_tokens, theoretical_speedup  # noqa: F401 - re-exported


@dataclass(frozen=True)
class BatchLoad:
    """The rest of a step's batch, as one request's K policy weighs it (`choose_ks`)."""

    other_tokens: int = 0  # verify tokens of the other rows (K + 1 each)
    other_expected: float = 0.0  # tokens the other batch-aware rows are expected to emit
    rows: int = 1  # rows drafting together (a batched draft forward costs more than a single one)


class KPolicy(Protocol):
    """How one request chooses K each step."""

    #: K weighs the batch and measured costs (auto-K): `choose_ks` tells it the rest of the batch,
    #: and reads its `last_k` and `expected_tokens` to tell the others.
    batch_aware: bool
    #: It proposes at all (FixedK(0) is target-only decoding).
    drafts: bool

    def next_k(self, load: BatchLoad = BatchLoad()) -> int:
        """K for the next step."""

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """What the target accepted of the last proposal."""

    def independent(self) -> "KPolicy":
        """A policy whose K depends on this request's own history only (a seeded `residual` request:
        its text depends on K)."""


class FixedK:
    batch_aware = False

    def __init__(self, k: int) -> None:
        self.k = k
        self.drafts = k > 0

    def next_k(self, load: BatchLoad = BatchLoad()) -> int:
        return self.k

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        pass

    def independent(self) -> "FixedK":
        return self


class HeuristicK:
    """K from the request's own acceptance alone: Hugging Face assisted generation's "heuristic"
    schedule (+2 after a wholly accepted proposal, -1 otherwise, within 1..speculative_tokens_limit).

    Auto-K weighs measured timings and the batch; this does not, so the K sequence (and with it a
    residual-sampled request's text) is a function of the request alone. Used for seeded
    `residual` requests that ask for auto."""

    batch_aware = False
    drafts = True

    def __init__(self, speculative_tokens_limit: int, k_initial: int = 4) -> None:
        self.speculative_tokens_limit = speculative_tokens_limit
        self.k = max(1, min(k_initial, speculative_tokens_limit))

    def next_k(self, load: BatchLoad = BatchLoad()) -> int:
        return self.k

    def independent(self) -> "HeuristicK":
        return self

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed > 0:
            self.k = min(self.k + 2, self.speculative_tokens_limit) if num_accepted >= num_proposed else max(1, self.k - 1)


#: Timed 1-token forwards (after the warm-up) before a request alone weighs any K against them.
BASELINE_SAMPLES = 3


@dataclass
class CostModel:
    """Recent timings (seconds) of what a step costs, one window per kind of forward.

    Each estimate is the minimum of the last `window` observations, not a mean: on a shared machine
    noise only ever adds time, and sizes are measured at different moments (K=0 steps time the
    1-token forward, K>0 steps the (K+1)-token one), so a mean lets a burst of contention during one
    kind of step tilt the comparison. The minimum over a short window tracks the quiet-machine cost
    and still follows real drift (longer contexts) within `window` steps.
    """

    window: int = 8
    samples: dict = field(default_factory=dict)  # num input tokens -> recent one-forward timings
    draft_samples: dict = field(default_factory=dict)  # batch rows -> recent one-draft-forward timings
    draft_call_samples: deque = field(default_factory=deque)  # per drafting step, outside the draft's forwards
    overhead_seconds: float = 0.0  # per step, outside the forwards (sampling, verification, bookkeeping)
    seen: set = field(default_factory=set)  # kinds whose first (warm-up) timing was dropped

    def _warm(self, key) -> bool:
        """The first call at a new size builds kernels (oneDNN primitives, allocator pools): drop it."""
        if key in self.seen:
            return True
        self.seen.add(key)
        return False

    def _push(self, window: deque, seconds: float) -> None:
        window.append(seconds)
        while len(window) > self.window:
            window.popleft()

    def observe_target(self, num_tokens: int, seconds: float) -> None:
        if self._warm(("target", num_tokens)):
            self._push(self.samples.setdefault(num_tokens, deque()), seconds)

    def observe_draft(self, num_forwards: int, seconds: float, rows: int = 1) -> None:
        """A drafting call of `num_forwards` forwards over `rows` batch rows took `seconds`."""
        if num_forwards > 0 and self._warm(("draft", rows)):
            self._push(self.draft_samples.setdefault(rows, deque()), seconds / num_forwards)

    def observe_draft_call(self, seconds: float) -> None:
        """Time a drafting step spent outside the draft's own work (e.g. a remote call's round trip)."""
        if self._warm("draft_call"):
            self._push(self.draft_call_samples, seconds)

    def observe_overhead(self, seconds: float) -> None:
        self.overhead_seconds = 0.7 * self.overhead_seconds + 0.3 * max(0.0, seconds)

    @property
    def target_seconds(self) -> dict[int, float]:
        """Estimated one-forward time per number of input tokens measured so far."""
        return {n: min(window) for n, window in self.samples.items() if window}

    @property
    def draft_seconds(self) -> float | None:
        """One single-row draft forward (or the smallest batch measured)."""
        return self.draft_cost(1)

    @property
    def draft_call_seconds(self) -> float:
        return min(self.draft_call_samples) if self.draft_call_samples else 0.0

    def draft_cost(self, rows: int = 1) -> float | None:
        """One draft forward over `rows` batch rows, interpolated from the batch sizes seen so far."""
        return _interpolate({n: min(w) for n, w in self.draft_samples.items() if w}, rows)

    def target_cost(self, num_tokens: int) -> float | None:
        """Forward time for `num_tokens` input tokens (all rows of a batch together), interpolated
        from the sizes seen so far."""
        return _interpolate(self.target_seconds, num_tokens)

    @property
    def cost_ratio(self) -> float | None:
        """c: one draft forward over one target forward (both single-token)."""
        t1 = self.target_cost(1)
        if self.draft_seconds is None or not t1:
            return None
        return self.draft_seconds / t1


def _interpolate(known: dict[int, float], num_tokens: int) -> float | None:
    """Piecewise-linear through the measured sizes, extended from the nearest segment."""
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


class AutoK:
    """Per-request K policy over an engine-wide `CostModel`.

    Acceptance is tracked per proposal position (decayed counts), because it falls with depth: the
    expected tokens of a K-token proposal are 1 + sum_i prod_{j<=i} a_j with a_j the conditional
    acceptance rate at position j (Leviathan's i.i.d. formula is the special case a_j = a). Positions
    not yet explored borrow the rate of the one before.
    """

    batch_aware = True
    drafts = True

    def __init__(
        self,
        costs: CostModel,
        speculative_tokens_limit: int,
        k_initial: int = 4,
        prior_alpha: float = 0.6,
        prior_weight: float = 2.0,
        decay: float = 0.9,
        probe_interval: int = 8,
        max_probe_interval: int = 256,
    ) -> None:
        self.costs = costs
        self.speculative_tokens_limit = speculative_tokens_limit
        self.k_initial = min(k_initial, speculative_tokens_limit)
        self.prior_alpha, self.prior_weight, self.decay = prior_alpha, prior_weight, decay
        self.accepted = [0.0] * speculative_tokens_limit  # decayed counts per position
        self.reached = [0.0] * speculative_tokens_limit
        self.probe_interval = self.min_probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.steps_without_draft = 0
        self.last_k = self.k_initial

    def position_rates(self) -> list[float]:
        """Conditional acceptance rate at each position, given the ones before were accepted."""
        rates, prior = [], self.prior_alpha
        for accepted, reached in zip(self.accepted, self.reached):
            rate = (accepted + prior * self.prior_weight) / (reached + self.prior_weight)
            rates.append(rate)
            prior = rate
        return rates

    @property
    def alpha(self) -> float:
        """Overall acceptance rate (accepted / judged positions)."""
        return (sum(self.accepted) + self.prior_alpha * self.prior_weight) / (sum(self.reached) + self.prior_weight)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:
            return
        self.accepted = [a * self.decay for a in self.accepted]
        self.reached = [r * self.decay for r in self.reached]
        # Positions the target judged: the accepted ones plus the first rejected one, if any.
        judged = min(num_proposed, num_accepted + 1)
        for j in range(min(judged, self.speculative_tokens_limit)):
            self.reached[j] += 1
            if j < num_accepted:
                self.accepted[j] += 1

    def expected_tokens(self, k: int) -> float:
        total, survive = 1.0, 1.0
        for rate in self.position_rates()[:k]:
            survive *= rate
            total += survive
        return total

    def rate(self, k: int, other_tokens: int = 0, other_expected: float = 0.0, rows: int = 1) -> float | None:
        """Expected tokens per second of the step with K proposals for this request, or None while a
        cost is unmeasured. In a batch the step also verifies `other_tokens` rows of the other
        requests, which emit `other_expected` tokens: the step's cost is the target's at the batch's
        total rows, so a larger K pays only while the verify cost curve stays flat."""
        target = self.costs.target_cost(other_tokens + k + 1)
        draft = self.costs.draft_cost(rows)
        if target is None or (k > 0 and draft is None):
            return None
        seconds = target + self.costs.overhead_seconds
        if k > 0:
            seconds += k * (draft or 0.0) + self.costs.draft_call_seconds
        return (self.expected_tokens(k) + other_expected) / seconds if seconds > 0 else None

    def best_k(self, other_tokens: int = 0, other_expected: float = 0.0, rows: int = 1) -> int:
        rates = {k: self.rate(k, other_tokens, other_expected, rows) for k in range(self.speculative_tokens_limit + 1)}
        if rates[0] is None or (other_tokens == 0 and len(self.costs.samples.get(1, ())) < BASELINE_SAMPLES):
            # Measure plain decoding first: it is the baseline every K is weighed against, and a
            # request alone stops measuring it once it drafts, so one sample hit by contention
            # would make a useless draft look worth running for the rest of the request.
            return 0
        if rates[self.k_initial] is None:
            return self.k_initial  # measure the draft
        known = {k: r for k, r in rates.items() if r is not None}
        return max(known, key=lambda k: (known[k], -k))

    def _explore(self, best: int, other_tokens: int) -> int:
        """Learn the verify curve once: while drafting alone, each K whose verify size the engine has
        never timed is tried (the nearest to the best first), so measured costs replace guesses.
        Straight lines between measured sizes misjudge kernels that work in blocks of rows (int4:
        4 rows a block, so 4 tokens cost little more than 1 and 5 twice that). The costs are the
        engine's, so this happens in its first requests only; greedy and invariant text never
        depend on K."""
        if best == 0 or other_tokens:
            return best
        untimed = [k for k in range(1, self.speculative_tokens_limit + 1) if not self.costs.samples.get(k + 1)]
        return min(untimed, key=lambda k: (abs(k - best), k)) if untimed else best

    def next_k(self, load: BatchLoad = BatchLoad()) -> int:
        """K for the next step (alone, or in a batch: see `rate`)."""
        k = self._explore(self.best_k(load.other_tokens, load.other_expected, load.rows), load.other_tokens)
        if k > 0:
            self.probe_interval = self.min_probe_interval
            self.steps_without_draft = 0
        else:
            self.steps_without_draft += 1
            if self.steps_without_draft >= self.probe_interval and self.costs.draft_seconds is not None:
                # Probe: a short proposal refreshes the acceptance estimate; back off while it stays bad.
                self.steps_without_draft = 0
                self.probe_interval = min(2 * self.probe_interval, self.max_probe_interval)
                k = min(2, self.speculative_tokens_limit)
        self.last_k = k
        return k

    def independent(self) -> HeuristicK:
        return HeuristicK(self.speculative_tokens_limit)


def choose_ks(policies: Sequence[KPolicy | None]) -> list[int]:
    """K of each row of a step (None: the row does not draft). Batch-aware rows weigh their expected
    tokens against the step's cost at the batch's total verify rows, so K shrinks as the batch grows
    (and is 0 once the target is compute-bound); each learns what the rows before it chose."""
    ks = [0] * len(policies)
    fixed_tokens, aware = 0, []
    for i, policy in enumerate(policies):
        if policy is None:
            continue
        if policy.batch_aware:
            aware.append(i)
        else:
            ks[i] = policy.next_k()
            fixed_tokens += ks[i] + 1
    if aware:
        tokens = fixed_tokens + sum(policies[i].last_k + 1 for i in aware)
        expected = sum(policies[i].expected_tokens(policies[i].last_k) for i in aware)
        for i in aware:
            policy = policies[i]
            mine_tokens, mine_expected = policy.last_k + 1, policy.expected_tokens(policy.last_k)
            ks[i] = policy.next_k(BatchLoad(tokens - mine_tokens, expected - mine_expected, len(policies)))
            tokens += ks[i] + 1 - mine_tokens
            expected += policy.expected_tokens(ks[i]) - mine_expected
    return ks


def make_policy(config: EngineConfig, costs: CostModel, override: int | str | None = None,
                has_draft: bool = True) -> KPolicy:
    """The K policy of one request: the engine's setting, or a per-request override (an int, "auto",
    or 0 to decode this request with the target alone)."""
    if not has_draft or (override == 0 and not isinstance(override, bool)):
        return FixedK(0)
    k = config.num_speculative_tokens if override is None else override
    if isinstance(k, str) and k.strip().lower() == AUTO:
        return AutoK(costs, config.max_speculative_tokens if override is not None else config.speculative_tokens_limit)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer >= 1 or 'auto', got {k!r}")
    return FixedK(k)
