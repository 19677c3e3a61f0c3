"""Turning runs into the numbers that matter: medians, paired speedups, acceptance, the cost ratio
c, Leviathan's theoretical speedup and how close each method gets to it; written as JSON, a
Markdown table and PNG plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.methods import Run
from specdec.decoding.speculation_length import theoretical_speedup
from specdec.decoding.stats import SpeculativeStats


def summarize(runs: dict[str, list[Run | None]], baseline: str, reference: str, ks: dict, groups: dict,
              greedy: bool) -> list[dict]:
    """One row per method. `runs[method][i]` is prompt i's run (None if the method did not run it);
    `baseline` is what speedups are measured against (no speedups where it did not run);
    `reference` is the specdec target-only method whose per-token forward time anchors the cost
    ratio c."""
    base = runs.get(baseline, [])
    ref_stats = _merged(runs.get(reference, []))
    t1 = ref_stats.target_seconds / ref_stats.target_forwards if ref_stats and ref_stats.target_forwards else None
    rows = []
    for name, method_runs in runs.items():
        pairs = [(r, b) for r, b in zip(method_runs, base) if r is not None and b is not None]
        done = [r for r in method_runs if r is not None]
        if not done:
            continue
        row = {
            "method": name,
            "group": groups.get(name, ""),
            "k": ks.get(name),
            "prompts": len(done),
            "tokens": sum(len(r.token_ids) for r in done),
            "tokens_per_second": statistics.median(r.tokens_per_second for r in done),
            "speedup": statistics.median(r.tokens_per_second / b.tokens_per_second for r, b in pairs) if pairs else None,
        }
        if greedy:
            row["identical_to_baseline"] = sum(r.token_ids == b.token_ids for r, b in pairs) if pairs else None
        stats = _merged(method_runs)
        if stats is not None:
            row.update(_speculation(stats, row, t1))
        rows.append(row)
    return rows


def _merged(runs) -> SpeculativeStats | None:
    stats = [r.stats for r in runs if r is not None and r.stats is not None]
    if not stats:
        return None
    total = SpeculativeStats()
    for s in stats:
        total.merge(s)
    return total


def _speculation(stats: SpeculativeStats, row: dict, t1: float | None) -> dict:
    out = {
        "acceptance_rate": stats.acceptance_rate if stats.num_draft_tokens else None,
        "alpha": stats.token_acceptance_rate if stats.num_draft_tokens else None,
        "mean_accepted_length": stats.mean_accepted_length if stats.num_drafts else None,
        "acceptance_by_position": [a / p if p else None for a, p in
                                   zip(stats.accepted_per_position, stats.proposed_per_position)],
        "target_forwards_per_token": stats.target_forwards / row["tokens"] if row["tokens"] else None,
        "pipeline_hits": stats.pipeline_hits,
        "pipeline_misses": stats.pipeline_misses,
    }
    mean_k = stats.num_draft_tokens / stats.num_drafts if stats.num_drafts else 0.0
    out["mean_k"] = mean_k
    c = None
    if t1 and stats.draft_forwards:
        c = (stats.draft_seconds / stats.draft_forwards) / t1
    elif t1 and stats.num_drafts:
        c = (stats.draft_seconds / stats.num_drafts) / t1  # model-free proposer: one lookup per step
    out["cost_ratio_c"] = c
    alpha = out["alpha"]
    if c is not None and alpha is not None and mean_k > 0:
        theory = theoretical_speedup(alpha, round(mean_k), c)
        out["theoretical_speedup"] = theory
        out["efficiency"] = row["speedup"] / theory if row["speedup"] else None
    return out


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return format(value, spec) + suffix
    return str(value)


def cpu_line(meta: dict) -> str:
    cpu = meta.get("cpu") or {}
    cap = f", capped at {cpu['cap']}" if cpu.get("cap") else ""
    return f"{cpu.get('model', meta.get('machine'))} ({' '.join(cpu.get('flags', []))}{cap})"


def _calibration_line(meta: dict) -> str:
    from specdec.kernels.calibration import describe

    calibration = meta.get("calibration") or {}
    return "; ".join(f"{name.replace('_', ' ')} {describe(calibration.get(name))}"
                     for name in ("linear_kernel", "draft_precision") if calibration.get(name))


def markdown(rows: list[dict], meta: dict) -> str:
    greedy = "identical_to_baseline" in (rows[0] if rows else {})
    head = ["method", "K", "tok/s (median)", "speedup", "acceptance", "α", "mean acc. len", "fwd/token", "c",
            "theory", "efficiency"] + (["= baseline"] if greedy else []) + ["÷ paired run"] \
        + (["= paired run"] if greedy else [])
    lines = [f"# specdec bench: {meta['target']} (draft {meta['draft']})", "",
             f"{meta['num_prompts']} prompts ({meta['prompts']}), {meta['max_tokens']} new tokens, "
             f"{'greedy' if greedy else 'temperature ' + str(meta['temperature'])}, {meta['device']}, "
             f"{meta['threads']} threads; speedup = median over prompts of tok/s ÷ baseline ({meta['baseline']}) "
             "tok/s on the same prompt; acceptance = accepted / proposed tokens; α = accepted / judged "
             "positions (Leviathan's per-token rate); c = draft forward ÷ target single-token forward; "
             "theory = (1-α^(K+1))/((1-α)(cK+1)); efficiency = speedup ÷ theory.", "",
             f"CPU: {cpu_line(meta)}; target kernel {meta.get('linear_kernel')}, draft "
             f"{meta.get('draft_precision')} (auto: {_calibration_line(meta)}).", "",
             *_phase_lines(meta),
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        k = r.get("k")
        k_cell = f"auto ({r['mean_k']:.1f})" if k == "auto" and r.get("mean_k") else _fmt(k)
        cells = [r["method"], k_cell, _fmt(r["tokens_per_second"]), _fmt(r.get("speedup"), ".2f", "×"),
                 _fmt(r.get("acceptance_rate"), ".1%"), _fmt(r.get("alpha"), ".3f"), _fmt(r.get("mean_accepted_length")),
                 _fmt(r.get("target_forwards_per_token"), ".3f"), _fmt(r.get("cost_ratio_c"), ".3f"),
                 _fmt(r.get("theoretical_speedup"), ".2f", "×"), _fmt(r.get("efficiency"), ".0%")]
        if greedy:
            same = r["identical_to_baseline"]
            cells.append("–" if same is None else f"{same}/{r['prompts']}")
        cells.append(_fmt(r.get("vs_in_process"), ".3f"))
        if greedy:
            same = r.get("identical_to_pair")
            cells.append("–" if same is None else f"{same}/{r['prompts']}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _phase_lines(meta: dict) -> list[str]:
    """What did not run as planned (above the table, so a partial table is read as one), and how
    the Ray rows were paired with the in-process engine."""
    lines = []
    if meta.get("interrupted"):
        lines.append("**Interrupted** (Ctrl-C): the rows below are what was measured before it.")
    for item in meta.get("skipped", []):
        lines.append(f"**Skipped** {item['phase']}: {item['reason']}.")
    for item in meta.get("failed", []):
        lines.append(f"**Failed** {item['phase']}: {item['error']} (what it measured before is kept below).")
    pairing = meta.get("ray_pairing") or {}
    if pairing:
        lines.append("Ray rows ÷ paired run: the in-process engine at the defaults, "
                     + "; ".join(f"{name} {how}" for name, how in pairing.items())
                     + " (interleaved: prompt by prompt; before/after: every prompt just before and just after "
                       "the Ray engine, mean of the two times).")
    return [line for item in lines for line in (item, "")]


def plots(rows: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    # 1. Speedup by method, with the theoretical bound where there is one.
    # Horizontal bars: method names are long ("specdec-auto (pair of ray-tp1-colocated)").
    fig, ax = plt.subplots(figsize=(7.5, 1.6 + 0.42 * len(rows)))
    names = [r["method"] for r in rows]
    speedups = [r.get("speedup") or 0 for r in rows]
    colors = {"hf": "#9e9e9e", "specdec": "#1f77b4", "ray": "#2ca02c"}
    y = list(range(len(rows)))
    ax.barh(y, speedups, color=[colors.get(r["group"], "#1f77b4") for r in rows], label="measured")
    for i, s in enumerate(speedups):
        if s:
            ax.text(s, i, f" {s:.2f}×", va="center", fontsize=8)
    theory = [(i, r["theoretical_speedup"]) for i, r in enumerate(rows) if r.get("theoretical_speedup")]
    if theory:
        ax.scatter([t for _, t in theory], [i for i, _ in theory], marker="|", s=300, color="#d62728", zorder=3,
                   label="theoretical (α, c measured)")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()  # table order, top to bottom
    ax.set_xlim(0, 1.18 * max(speedups + [t for _, t in theory] + [1.0]))
    ax.set_xlabel("speedup vs baseline (median over prompts)")
    ax.set_title("Speedup by method")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=8, frameon=False)  # off the bars
    fig.tight_layout()
    written.append(_save(fig, out_dir / "speedup.png"))
    # 2. Acceptance by position.
    spec = [r for r in rows if r.get("acceptance_by_position")]
    if spec:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in spec:
            rates = r["acceptance_by_position"]
            ax.plot(range(1, len(rates) + 1), [x if x is not None else float("nan") for x in rates], marker="o",
                    label=r["method"])
        ax.set_xlabel("proposal position")
        ax.set_ylabel("accepted / proposed")
        ax.set_ylim(0, 1.05)
        ax.set_title("Acceptance by position")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, out_dir / "acceptance_by_position.png"))
    # 3. Speedup vs K (fixed-K methods of one group).
    sweep = sorted((r for r in rows if isinstance(r.get("k"), int) and r["group"] == "specdec" and r.get("speedup")),
                   key=lambda r: r["k"])
    if sweep:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["k"] for r in sweep], [r["speedup"] for r in sweep], marker="o", label="measured")
        if all(r.get("theoretical_speedup") for r in sweep):
            ax.plot([r["k"] for r in sweep], [r["theoretical_speedup"] for r in sweep], marker="x", linestyle="--",
                    label="theoretical")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("K (speculative tokens per step)")
        ax.set_ylabel("speedup vs baseline")
        ax.set_title("Speedup vs K")
        ax.legend()
        fig.tight_layout()
        written.append(_save(fig, out_dir / "speedup_vs_k.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write(out_dir: Path, rows: list[dict], meta: dict, per_prompt: dict,
          with_plots: bool = True) -> dict[str, Path]:
    """bench.json and bench.md, and the plots unless `with_plots` is False (the runner's checkpoints
    after each phase skip them: they are drawn once, at the end)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "bench.json", "markdown": out_dir / "bench.md"}
    paths["json"].write_text(json.dumps({"meta": meta, "summary": rows, "runs": per_prompt}, indent=2) + "\n")
    paths["markdown"].write_text(markdown(rows, meta))
    for p in plots(rows, out_dir) if with_plots and rows else []:
        paths[p.stem] = p
    return paths
