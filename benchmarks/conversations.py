"""`specdec bench --conversations chat,agent`: multi-turn workloads with prefix caching on and off.

Two engines share the same prepared target and draft (`SpeculativeEngine.sibling`), one with
`prefix_caching` on (the default) and one with it off, and run the same conversations turn by
turn, interleaved (turn t on one engine, then on the other, the order alternating per
conversation), so drift of the machine falls on both alike. Each turn sends the whole history, as
an OpenAI chat client does; the reply each engine generated is what its next turn sends back.

- `chat`: every conversation opens with the same ~500-token system prompt (a deployment's), asks
  to complete a HumanEval function, then three follow-ups: turn 1 of a conversation finds the
  system prompt another conversation left, turns 2-4 find their own history.
- `agent`: a tool-using loop: the system prompt plus four tool definitions (~1100 tokens, rendered
  by the chat template), a task, then tool results (a file, a test run, a test file) appended step
  by step; each step is a request whose prompt is the last one's plus the reply and a tool result.

- `misses`: single prompts (the bench prompts, no chat template) that never hit (each sent with a
  `cache_salt` of its own to the caching engine): what the cache's bookkeeping costs when it
  serves nothing.

Reported per workload and mode: time to first token per turn (median over conversations; the
streamed first chunk, which comes after the first speculative step), the prompt tokens computed
versus served from the cache, the whole conversation's time, decode tokens/s, and whether each
turn's greedy text is the same with and without the cache (the cache must change no output). After
each turn with the cache, a fresh prompt of only the tokens the cache did not serve (no history,
its own salt) is timed to its first token: a cached turn should cost what its new tokens cost.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.report import cpu_line
from specdec.config import SamplingParams
from specdec.kernels.cpu import cpu_info

WORKLOADS = ("chat", "agent", "misses")
MODES = ("cache", "no-cache")
DATA = Path(__file__).parent / "data" / "conversations.json"


@dataclass
class Turn:
    """One request of one conversation on one engine."""

    workload: str
    mode: str
    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    seconds: float
    decode_seconds: float
    text: str
    fresh_ttft_s: float | None = None  # a prompt of only this turn's uncached tokens, no history


def conversations(workload: str, count: int, prompts: list) -> list[dict]:
    """`count` conversation scripts of `workload`: the fixed messages before the first turn, the
    messages each later turn appends after the reply, and the tools."""
    data = json.loads(DATA.read_text())
    scripts = []
    for i in range(count):
        code = prompts[i % len(prompts)].text
        if workload == "misses":
            scripts.append({"opening": code, "later": [], "tools": None, "salt": f"miss-{i}"})
        elif workload == "chat":
            opening = [{"role": "system", "content": data["system"]},
                       {"role": "user", "content": f"Complete this function:\n```python\n{code}```"}]
            later = [[{"role": "user", "content": text}] for text in data["follow_ups"]]
            scripts.append({"opening": opening, "later": later, "tools": None})
        else:
            name = _function_name(code) or f"task_{i}"
            fields = {"module": f"src/{name}.py", "stem": name, "name": name, "code": code,
                      "test": f"tests/test_{name}.py::test_{name}_edge_cases"}
            opening = [{"role": "system", "content": data["system"]},
                       {"role": "user", "content": data["agent_task"].format(**fields)}]
            later = [[{"role": "tool", "content": out.format(**fields)}] for out in data["tool_outputs"]]
            scripts.append({"opening": opening, "later": later, "tools": data["tools"]})
    return scripts


def _function_name(code: str) -> str | None:
    for line in code.splitlines():
        if line.startswith("def "):
            return line[4:].split("(")[0].strip()
    return None


def _turn(engine, workload: str, mode: str, c: int, t: int, messages, tools, sampling, salt=None) -> Turn:
    start = time.perf_counter()
    first = None
    last = None
    chat = not isinstance(messages, str)
    for chunk in engine.generate_stream(messages, chat=chat, tools=tools, sampling=sampling, cache_salt=salt):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - start
        last = chunk
    seconds = time.perf_counter() - start
    out = last.output
    return Turn(workload, mode, c, t, out.prompt_tokens, out.cached_tokens, out.completion_tokens,
                round(first if first is not None else seconds, 4), round(seconds, 4), round(out.decode_seconds, 4),
                out.text)


def _fresh_ttft(engine, messages, tools, cached_tokens: int, sampling, salt: str) -> float:
    """Time to the first chunk of a prompt of only the tokens after the first `cached_tokens` of
    this turn's prompt (nothing before them, a salt no entry has). It runs to its end: a cancelled
    request's step may still be running when the sibling engine starts on the same weights."""
    from specdec.engine.request import GenerationRequest

    ids, _ = engine.prompts(GenerationRequest(messages, chat=True, tools=tools, sampling=sampling))
    start = time.perf_counter()
    first = None
    for chunk in engine.generate_stream(prompt_token_ids=ids[cached_tokens:], sampling=sampling, cache_salt=salt):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - start
    return round(first if first is not None else time.perf_counter() - start, 4)


def run(target_spec: str, draft_spec: str, workloads: tuple[str, ...], count: int, sampling: SamplingParams,
        out_dir: Path, prompts: list, num_threads: int | None = None, command: str = "") -> tuple[list[dict], dict]:
    from tqdm.auto import tqdm

    from specdec import EngineConfig, SpeculativeEngine

    started = time.time()
    config = EngineConfig(target=target_spec, draft=draft_spec, num_threads=num_threads)
    cached = SpeculativeEngine.from_config(config)
    uncached = cached.sibling(prefix_caching=False)
    engines = {"cache": cached, "no-cache": uncached}
    scripts = {w: conversations(w, count, prompts) for w in workloads}
    turns: list[Turn] = []
    total = sum(len(s["later"]) + 1 for w in workloads for s in scripts[w]) * len(MODES)
    try:
        warm = [{"role": "user", "content": "Say hello."}]
        for engine in engines.values():  # kernels, allocator pools: once each, untimed
            engine.generate(warm, chat=True, sampling=SamplingParams(max_tokens=8))
        with tqdm(total=total, desc="bench --conversations", unit="req", file=sys.stderr, dynamic_ncols=True) as bar:
            for workload in workloads:
                for c, script in enumerate(scripts[workload]):
                    opening = script["opening"]
                    history = {mode: opening if isinstance(opening, str) else list(opening) for mode in MODES}
                    order = MODES if c % 2 == 0 else MODES[::-1]
                    for t in range(len(script["later"]) + 1):
                        for mode in order:
                            bar.set_postfix_str(f"{workload} #{c} turn {t + 1} {mode}")
                            salt = script.get("salt") if mode == "cache" else None
                            turn = _turn(engines[mode], workload, mode, c, t + 1, history[mode], script["tools"],
                                         sampling, salt)
                            if mode == "cache" and workload != "misses":
                                turn.fresh_ttft_s = _fresh_ttft(engines[mode], history[mode], script["tools"],
                                                                turn.cached_tokens, sampling,
                                                                f"fresh-{workload}-{c}-{t}")
                            turns.append(turn)
                            bar.update()
                            if t < len(script["later"]):
                                history[mode] += [{"role": "assistant", "content": turn.text}] + script["later"][t]
        meta = {"target": target_spec, "draft": draft_spec, "workloads": list(workloads), "conversations": count,
                "max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
                "target_precision": cached.target_precision, "draft_precision": cached.draft_precision,
                "kv_budget_bytes": cached.scheduler.budget.total if cached.scheduler.budget else None,
                "prefix_cache_bytes": cached.scheduler.prefix_bytes,
                "prefix_evictions": cached.scheduler.prefix_evictions,
                "threads": torch.get_num_threads(), "cpu": cpu_info().as_dict(), "torch": torch.__version__,
                "seconds": round(time.time() - started, 1), "command": command}
    finally:
        for engine in engines.values():
            engine.shutdown()
    rows = summarize(turns)
    return rows, write(out_dir, rows, turns, meta)


def summarize(turns: list[Turn]) -> list[dict]:
    """One row per workload and mode: per-turn median TTFT, prompt tokens computed and cached, the
    conversations' time, and how many turns equal the other mode's."""
    rows = []
    other = {(t.workload, t.mode, t.conversation, t.turn): t.text for t in turns}
    for workload in dict.fromkeys(t.workload for t in turns):
        for mode in MODES:
            mine = [t for t in turns if t.workload == workload and t.mode == mode]
            if not mine:
                continue
            by_turn: dict[int, list[Turn]] = {}
            for t in mine:
                by_turn.setdefault(t.turn, []).append(t)
            twin = MODES[1 - MODES.index(mode)]
            decode_tokens = sum(max(t.completion_tokens - 1, 0) for t in mine)
            decode_seconds = sum(t.decode_seconds for t in mine)
            fresh = {k: [x.fresh_ttft_s for x in v if x.fresh_ttft_s is not None] for k, v in by_turn.items()}
            rows.append({
                "workload": workload, "mode": mode, "requests": len(mine),
                "fresh_ttft_median_by_turn": [round(statistics.median(fresh[k]), 3) if fresh[k] else None
                                              for k in sorted(by_turn)],
                "ttft_median_by_turn": [round(statistics.median(x.ttft_s for x in by_turn[k]), 3)
                                        for k in sorted(by_turn)],
                "prompt_tokens_by_turn": [round(statistics.mean(x.prompt_tokens for x in by_turn[k]))
                                          for k in sorted(by_turn)],
                "ttft_median": round(statistics.median(t.ttft_s for t in mine), 3),
                "prompt_tokens": sum(t.prompt_tokens for t in mine),
                "cached_tokens": sum(t.cached_tokens for t in mine),
                "computed_tokens": sum(t.prompt_tokens - t.cached_tokens for t in mine),
                "seconds": round(sum(t.seconds for t in mine), 2),
                "decode_tokens_per_second": round(decode_tokens / decode_seconds, 2) if decode_seconds else None,
                "identical_to_other_mode": sum(t.text == other.get((workload, twin, t.conversation, t.turn))
                                               for t in mine),
            })
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Multi-turn conversations, prefix caching on and off", "",
             f"`{meta['command']}`", "",
             f"Target {meta['target']} ({meta['target_precision']}), draft {meta['draft']} "
             f"({meta['draft_precision']}), greedy, {meta['max_tokens']} tokens per turn, "
             f"{meta['conversations']} conversations per workload, {meta['threads']} threads. "
             f"CPU: {cpu_line(meta)}.", "",
             "| workload | mode | TTFT median per turn (s) | the new tokens alone (s) | prompt tokens per turn "
             "| computed / cached prompt tokens | total s | decode tok/s | same text as the other mode |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fresh = ", ".join("-" if x is None else f"{x:.2f}" for x in r["fresh_ttft_median_by_turn"])
        lines.append(f"| {r['workload']} | {r['mode']} | {', '.join(f'{x:.2f}' for x in r['ttft_median_by_turn'])} "
                     f"| {fresh} "
                     f"| {', '.join(map(str, r['prompt_tokens_by_turn']))} "
                     f"| {r['computed_tokens']} / {r['cached_tokens']} | {r['seconds']:.1f} "
                     f"| {r['decode_tokens_per_second']} | {r['identical_to_other_mode']}/{r['requests']} |")
    lines.append("")
    for workload in dict.fromkeys(r["workload"] for r in rows):
        pair = {r["mode"]: r for r in rows if r["workload"] == workload}
        if len(pair) == 2 and workload == "misses":
            on, off = pair["cache"], pair["no-cache"]
            lines.append(f"- misses (never a hit): with the cache's bookkeeping {on['seconds']:.1f} s and "
                         f"{on['decode_tokens_per_second']} decode tok/s, without {off['seconds']:.1f} s and "
                         f"{off['decode_tokens_per_second']} tok/s: {off['seconds'] / on['seconds']:.3f}x.")
        elif len(pair) == 2 and pair["cache"]["seconds"]:
            on, off = pair["cache"], pair["no-cache"]
            alone = [f"{a / b:.2f}x" if a and b else "-" for a, b in zip(on["ttft_median_by_turn"],
                                                                        on["fresh_ttft_median_by_turn"])]
            ratio = [f"{b / a:.1f}x" if a else "-" for a, b in zip(on["ttft_median_by_turn"],
                                                                    off["ttft_median_by_turn"])]
            lines.append(f"- {workload}: TTFT with the cache is {', '.join(ratio)} faster per turn; the whole "
                         f"workload {off['seconds'] / on['seconds']:.2f}x faster; "
                         f"{on['cached_tokens'] / max(on['prompt_tokens'], 1):.0%} of prompt tokens served "
                         f"from the cache; a cached turn's TTFT is {', '.join(alone)} that of its new tokens alone.")
    lines.append(f"- The prefix cache held {meta['prefix_cache_bytes'] / 2**20:.0f} MiB at the end "
                 f"(KV budget {_mib(meta['kv_budget_bytes'])}), {meta['prefix_evictions']} evictions.")
    return "\n".join(lines) + "\n"


def _mib(value) -> str:
    return "unbounded" if value is None else f"{value / 2**20:.0f} MiB"


def plot(rows: list[dict], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w in dict.fromkeys(r["workload"] for r in rows) if w != "misses"]
    if not workloads:
        return None
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.2 * len(workloads), 3.8), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for r in rows:
            if r["workload"] == workload:
                turns = range(1, len(r["ttft_median_by_turn"]) + 1)
                ax.plot(turns, r["ttft_median_by_turn"], marker="o", label=f"{r['mode']}")
                if r["mode"] == "cache":
                    ax.plot(turns, r["fresh_ttft_median_by_turn"], marker="x", linestyle=":",
                            label="the new tokens alone (no history)")
                for x, y, n in zip(turns, r["ttft_median_by_turn"], r["prompt_tokens_by_turn"]):
                    if r["mode"] == "no-cache":
                        ax.annotate(f"{n} tok", (x, y), textcoords="offset points", xytext=(0, 6), fontsize=7,
                                    ha="center")
        ax.set_title(f"{workload}: time to first token per turn")
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT median (s)")
        ax.set_xticks(list(turns))
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(out_dir: Path, rows: list[dict], turns: list[Turn], meta: dict) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "bench-conversations.json", "markdown": out_dir / "bench-conversations.md",
             "plot": out_dir / "ttft_per_turn.png"}
    paths["json"].write_text(json.dumps({"meta": meta, "summary": rows,
                                         "turns": [asdict(t) for t in turns]}, indent=2))
    paths["markdown"].write_text(markdown(rows, meta))
    if plot(rows, paths["plot"]) is None:
        del paths["plot"]
    return paths
