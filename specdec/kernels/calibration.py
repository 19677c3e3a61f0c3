"""Load-time measurements that survive a busy machine, their cached records, and their run-time re-check.

Two defaults are chosen by measuring at load time, because what wins depends on the CPU: the
target's linear kernel (`linear.py`) and the draft's precision (`draft_precision.py`). Both use
this module:

- **Interleaved rounds, minimum per candidate** (`measure_rounds`): every candidate is timed once
  per round, the rounds rotate the order, and each candidate's figure is its minimum over the
  rounds. Load from other processes only ever adds time, so the minimum tracks the quiet figure,
  and interleaving makes a burst of load hit every candidate alike.
- **Conditions recorded** (`LoadMonitor`): the CPU time other processes used while measuring (from
  `/proc/stat`, minus this process's own), the 1-minute load average, and each candidate's spread
  over the rounds (median over minimum).
- **Trusted only when consistent**: the callers check their figures against what physics allows
  (a draft's cost cannot exceed what its size allows; a kernel's 5-token pass cannot cost much less
  than the same kernel's 1-token pass) and measure again when they are not. A decision from figures
  that stay inconsistent is used for this start but never cached (`Record.trusted`).
- **Cached when robust to the noise seen**: a decision is cached when it was measured on a quiet
  machine (no other process busy), and its rounds agreed, or disagreed in a way that could not have
  changed it: the choice made from each candidate's minimum equals the choice made from its median
  over the rounds. A choice that noise could flip, or one measured while other processes ran, is
  used for this start only, and the log says why.
- **Cached per CPU** (`load_record` / `save_record`): `$SPECDEC_CACHE/calibration/<digest>.json`
  holds the key (models, threads, CPU model and flags, torch), the choice, every measurement, the
  conditions and the date.
- **Re-checked at run time** (`RuntimeCheck`): auto-K measures the draft's and the target's costs on
  every step (`speculation_length.CostModel`). When they contradict the calibration's prediction for
  many checks in a row, the record is marked contradicted, with the reason, and the next start
  measures again (`specdec models calibrate` does it on demand).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdec.models import model_cache
from specdec.config import env
from specdec.kernels.cpu import cpu_info

logger = logging.getLogger(__name__)

#: Other processes using more than this many cores' worth of CPU while measuring means "under load".
MAX_OTHERS_CORES = 0.35
#: A candidate whose median over the rounds exceeds its minimum by more than this was disturbed.
MAX_SPREAD = 0.5
#: Format of the records; older ones are measured again.
RECORD_VERSION = 2
#: Set (to anything but "" or "0") to ignore cached decisions and measure again (`specdec models calibrate`).
RECALIBRATE_ENV = "SPECDEC_RECALIBRATE"


def _busy_seconds() -> float | None:
    """CPU seconds all processes used since boot (`/proc/stat`: user, nice, system, irq, softirq, steal)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]
    busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + ticks[7]
    return busy / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


class LoadMonitor:
    """How much CPU other processes used between `start()` and `stop()`, in cores."""

    def __init__(self) -> None:
        self.others_cores: float | None = None
        self.load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    def start(self) -> LoadMonitor:
        self._wall, self._busy, self._own = time.perf_counter(), _busy_seconds(), _own_seconds()
        return self

    def stop(self) -> float | None:
        wall = time.perf_counter() - self._wall
        busy = _busy_seconds()
        if busy is None or self._busy is None or wall <= 0:
            return None
        self.others_cores = max(0.0, (busy - self._busy) - (_own_seconds() - self._own)) / wall
        return self.others_cores


@dataclass
class Conditions:
    """What the machine was doing while a calibration measured."""

    others_cores: float | None = None  # CPU used by other processes while measuring, in cores
    load_average: float | None = None  # 1-minute load average when it started
    spread: float = 0.0  # the most disturbed candidate's (median - min) / min over its rounds
    rounds: int = 0
    attempts: int = 0
    seconds: float = 0.0
    consistent: bool = True  # the figures passed the caller's physical checks
    # The choice from every candidate's minimum equals the choice from its median: the noise seen
    # could not have changed it (None: the caller gave no rule to choose by).
    robust: bool | None = None
    problems: list[str] = field(default_factory=list)  # why not quiet or not consistent

    @property
    def quiet(self) -> bool:
        return (self.others_cores is None or self.others_cores <= MAX_OTHERS_CORES) and self.spread <= MAX_SPREAD

    @property
    def trusted(self) -> bool:
        """A decision worth caching: consistent figures, no other process busy while measuring, and
        rounds that agreed, or disagreed in a way that could not change the choice (robust)."""
        others_ok = self.others_cores is None or self.others_cores <= MAX_OTHERS_CORES
        return self.consistent and others_ok and (self.spread <= MAX_SPREAD or bool(self.robust))

    def describe(self) -> str:
        others = "?" if self.others_cores is None else f"{self.others_cores:.2f}"
        load = "?" if self.load_average is None else f"{self.load_average:.2f}"
        return (f"{self.rounds} rounds in {self.attempts} attempt(s), {self.seconds:.1f}s; other processes used "
                f"{others} cores, load average {load}, spread {self.spread:.0%}")


def measure_rounds(timers: dict[str, Callable[[], float]], rounds: int,
                   samples: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Call every timer once per round, rotating the order each round; append to `samples`."""
    samples = samples if samples is not None else {name: [] for name in timers}
    names = list(timers)
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples.setdefault(name, []).append(timers[name]())
    return samples


def spread(times: list[float]) -> float:
    best = min(times)
    return (statistics.median(times) - best) / best if best > 0 else 0.0


def calibrate(timers: dict[str, Callable[[], float]], check: Callable[[dict[str, float]], list[str]],
              rounds: int = 5, attempts: int = 3,
              choose: Callable[[dict[str, float]], str] | None = None) -> tuple[dict[str, float], Conditions]:
    """Measure `timers` in interleaved rounds until the minima pass `check` (which returns the
    problems it finds, empty when consistent) and the decision can be trusted, for at most
    `attempts` attempts. Each timer's figure is its minimum over every round of every attempt (the
    minimum only improves); the conditions describe the last attempt (its load and spread).
    `choose` is the caller's rule (figures -> choice): the decision is robust when it picks the same
    from the minima and from the medians. The caller caches a decision only when the conditions are
    consistent, and quiet or robust (`Conditions.trusted`)."""
    started = time.perf_counter()
    samples: dict[str, list[float]] = {name: [] for name in timers}
    conditions = Conditions(load_average=os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
    for attempt in range(1, attempts + 1):
        monitor = LoadMonitor().start()
        latest = measure_rounds(timers, rounds)
        others = monitor.stop()
        for name, times in latest.items():
            samples[name].extend(times)
        minima = {name: min(times) for name, times in samples.items()}
        problems = check(minima)
        conditions.attempts, conditions.rounds = attempt, len(samples[next(iter(samples))])
        conditions.others_cores = others
        conditions.spread = max(spread(times) for times in latest.values())
        conditions.consistent = not problems
        conditions.problems = list(problems)
        if choose is not None:
            medians = {name: statistics.median(times) for name, times in samples.items()}
            by_min, by_median = choose(minima), choose(medians)
            conditions.robust = by_min == by_median
            if not conditions.robust:
                conditions.problems.append(f"the choice depends on the noise: {by_min} by the minima, {by_median} "
                                           "by the medians")
        if others is not None and others > MAX_OTHERS_CORES:
            conditions.problems.append(f"other processes used {others:.2f} cores while measuring")
        if conditions.spread > MAX_SPREAD:
            conditions.problems.append(f"a candidate's median was {conditions.spread:.0%} above its minimum")
        if conditions.trusted:
            break
        if attempt < attempts:
            logger.info("calibration attempt %d not trusted (%s); measuring again", attempt,
                        "; ".join(conditions.problems))
    conditions.seconds = time.perf_counter() - started
    return {name: min(times) for name, times in samples.items()}, conditions


def fastest(candidates, sizes) -> Callable[[dict[str, float]], str]:
    """The rule the kernel choices use (figures: "candidate/size" -> seconds): the candidate with the
    smallest sum over `sizes`, the earlier one on a tie within 2%."""
    def choose(figures: dict[str, float]) -> str:
        scores = {c: sum(figures[f"{c}/{n}"] for n in sizes) for c in candidates}
        best = min(scores.values())
        return next(c for c in candidates if scores[c] <= 1.02 * best)
    return choose


def by_size(minima: dict[str, float], candidates, sizes, name: str, seconds: str) -> list[dict]:
    """Each candidate's figures as a record's measurements: {name: c, "<seconds>_<n>": ..., verify_ratio}."""
    return [{name: c, **{f"{seconds}_{n}": minima[f"{c}/{n}"] for n in sizes},
             "verify_ratio": minima[f"{c}/{sizes[-1]}"] / minima[f"{c}/1"]} for c in candidates]


def log_sizes(what: str, conditions: Conditions, measurements: list[dict], name: str, seconds: str,
              sizes, unit: str) -> None:
    logger.info("%s measured (%s): %s", what, conditions.describe(),
                "; ".join(f"{m[name]} " + ", ".join(f"{n} {unit} {1000 * m[f'{seconds}_{n}']:.2f} ms" for n in sizes)
                          for m in measurements))


# ------------------------------------------------------------------------------------------ records

def calibration_dir() -> Path:
    return model_cache.cache_root() / "calibration"


def record_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return calibration_dir() / f"{digest}.json"


def base_key(kind: str) -> dict:
    """What every record's key holds: the kind of decision, this CPU, torch, the format."""
    import torch

    info = cpu_info()
    return {"kind": kind, "cpu": info.model, "cpu_flags": list(info.flags), "cpu_key": info.key,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "version": RECORD_VERSION}


@dataclass
class Record:
    """One cached decision (`choice`), how it was measured, and whether run time contradicted it."""

    key: dict
    choice: str
    measurements: list[dict]
    conditions: dict
    measured_at: str  # ISO date and time, UTC
    cpu: dict
    predicted: dict = field(default_factory=dict)  # what RuntimeCheck compares run-time costs with
    contradicted: dict | None = None  # {"reason", "at"} once run time contradicted it
    notes: list[str] = field(default_factory=list)  # e.g. candidates skipped on this CPU, and why
    path: str = ""  # where it is cached ("" when it was not cached)

    @property
    def cached(self) -> bool:
        return bool(self.path)

    @property
    def trusted(self) -> bool:
        """The figures passed the physical checks, on a quiet machine or robustly to its noise."""
        known = {k: v for k, v in self.conditions.items() if k in Conditions.__dataclass_fields__}
        return Conditions(**known).trusted

    def describe(self) -> str:
        """`onednn (verify_ratio 1.06, ...; measured 2026-12-05T20:31:07+00:00 on Intel(R) Xeon(R) ..., cached)`."""
        return describe(self.summary())

    def summary(self) -> dict:
        """The facts shown in logs, `/v1/models` and the info metric."""
        return {"choice": self.choice, "measured_at": self.measured_at, "cached": self.cached,
                "cpu": self.cpu.get("model"), "isa": self.cpu.get("isa"), "predicted": self.predicted,
                "conditions": self.conditions, "notes": self.notes, "path": self.path}


def describe(summary: dict | None) -> str:
    """One line for a `Record.summary()` (or a bare `{"choice": ...}`): the choice, the figures it
    predicted, when and on what CPU it was measured, and whether it is cached."""
    if not summary:
        return "none"
    if "measured_at" not in summary:
        return f"{summary['choice']} (set, not measured)"
    figures = ", ".join(f"{k} {v:.3g}" for k, v in summary.get("predicted", {}).items() if isinstance(v, (int, float)))
    state = "cached" if summary.get("cached") else "not cached"
    return (f"{summary['choice']} ({figures}{'; ' if figures else ''}measured {summary['measured_at']} on "
            f"{summary.get('cpu')}, {summary.get('isa')}, {state})")


def summarize(record: Record | None, choice: str) -> dict:
    """`record.summary()`, or just the choice where nothing was measured (set by hand, or a GPU)."""
    return record.summary() if record is not None else {"choice": choice}


def new_record(key: dict, choice: str, measurements: list[dict], conditions: Conditions,
               predicted: dict | None = None) -> Record:
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    return Record(key, choice, measurements, asdict(conditions), now, cpu_info().as_dict(), predicted or {})


def load_record(key: dict) -> Record | None:
    """The cached record for `key`, unless it is missing, unreadable, foreign or contradicted, or
    `$SPECDEC_RECALIBRATE` asks to measure again."""
    if env("RECALIBRATE", "") not in ("", "0"):
        logger.info("%s: measuring again ($%s is set)", key["kind"], RECALIBRATE_ENV)
        return None
    path = record_path(key)
    try:
        data = json.loads(path.read_text())
        record = Record(**{k: v for k, v in data.items() if k in Record.__dataclass_fields__})
    except (OSError, ValueError, TypeError):
        return None
    if record.key != json.loads(json.dumps(key)):
        return None
    if record.contradicted:
        logger.warning("re-measuring %s: the cached choice %r (%s) was contradicted at run time: %s", key["kind"],
                       record.choice, path, record.contradicted.get("reason"))
        return None
    record.path = str(path)
    return record


def save_record(record: Record) -> bool:
    """Cache `record` (atomically); False when the cache is not writable."""
    path = record_path(record.key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        data = asdict(record)
        data.pop("path")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not cache the %s decision in %s: %s", record.key.get("kind"), path, e)
        return False
    record.path = str(path)
    return True


def cache_if_trusted(record: Record) -> bool:
    """Cache `record` if it was measured quietly and consistently; otherwise say why not."""
    if record.trusted:
        return save_record(record)
    c = record.conditions
    logger.warning("%s %r: measured under load that could have changed it, or inconsistent (%s); used for this "
                   "start, not cached: the next start measures again", record.key.get("kind"), record.choice,
                   "; ".join(c.get("problems", [])) or f"spread {c.get('spread', 0):.0%} over the rounds")
    return False


def mark_contradicted(path: str, reason: str) -> bool:
    """Flag the cached record at `path` so the next start measures again; False if it is gone."""
    try:
        data = json.loads(Path(path).read_text())
        data["contradicted"] = {"reason": reason,
                                "at": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()}
        fd, tmp = tempfile.mkstemp(dir=Path(path).parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
        return True
    except (OSError, ValueError) as e:
        logger.warning("could not mark the calibration record %s as contradicted: %s", path, e)
        return False


# ---------------------------------------------------------------------------------- run-time check

class RuntimeCheck:
    """Compares the costs auto-K measures while serving with what calibration predicted.

    `predicted` maps a name to (predicted value, function of the `CostModel` giving the run-time
    value or None while unmeasured, the record path to flag). Every `every` steps each is compared;
    a value off by more than `tolerance` (relative, either way) counts a strike, a matching one
    clears them; `strikes` in a row flag the record (`mark_contradicted`) and stop checking it.
    Costs are windowed minima (quiet-machine estimates), so sustained load alone rarely strikes.
    """

    every = 32
    strikes_needed = 4
    tolerance = 0.35

    def __init__(self, predicted: dict[str, tuple[float, Callable, str]]) -> None:
        self.predicted = {name: p for name, p in predicted.items() if p[0] and p[2]}
        self.strikes = {name: 0 for name in self.predicted}
        self.steps = 0
        self.contradicted: dict[str, str] = {}  # name -> reason

    def after_step(self, costs) -> None:
        if not self.predicted:
            return
        self.steps += 1
        if self.steps % self.every:
            return
        for name, (expected, observe, path) in list(self.predicted.items()):
            seen = observe(costs)
            if seen is None:
                continue
            off = seen / expected
            if 1 / (1 + self.tolerance) <= off <= 1 + self.tolerance:
                self.strikes[name] = 0
                continue
            self.strikes[name] += 1
            if self.strikes[name] >= self.strikes_needed:
                reason = (f"{name} measured {seen:.3f} while serving (windowed minimum over "
                          f"{self.strikes_needed} checks {self.every} steps apart), calibration predicted "
                          f"{expected:.3f}")
                logger.warning("calibration contradicted: %s; %s is flagged and the next start measures again",
                               reason, path)
                mark_contradicted(path, reason)
                self.contradicted[name] = reason
                del self.predicted[name]


def observed_cost_ratio(costs) -> float | None:
    """c while serving: one single-row draft forward over one single-token target forward."""
    if not costs.draft_samples.get(1) or not costs.samples.get(1):
        return None
    return costs.cost_ratio


def observed_verify_ratio(costs, num_tokens: int) -> float | None:
    """The target's `num_tokens`-token forward over its single-token forward, while serving."""
    seconds = costs.target_seconds
    if 1 not in seconds or num_tokens not in seconds or not seconds[1]:
        return None
    return seconds[num_tokens] / seconds[1]


def runtime_check(kernel: dict | None, draft: dict | None, verify_tokens: int) -> RuntimeCheck:
    """The run-time check of an engine's two calibrations, given as `Record.summary()` dicts (either
    may be None or lack a path: not measured, or not cached, so there is nothing to flag)."""
    predicted = {}
    if draft and draft.get("path") and draft.get("predicted", {}).get("cost_ratio"):
        predicted["draft cost ratio c"] = (draft["predicted"]["cost_ratio"], observed_cost_ratio, draft["path"])
    if kernel and kernel.get("path") and kernel.get("predicted", {}).get("verify_ratio"):
        predicted[f"target {verify_tokens}-token/1-token forward ratio"] = (
            kernel["predicted"]["verify_ratio"], lambda costs: observed_verify_ratio(costs, verify_tokens),
            kernel["path"])
    return RuntimeCheck(predicted)
