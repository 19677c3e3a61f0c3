"""Tool calls: the model's own tool-call text <-> OpenAI's `tool_calls`, one parser per format.

The tool definitions reach the model through its chat template (`tokenizer.apply_chat_template(...,
tools=...)`); what it writes back is parsed here, as vLLM's `--tool-call-parser` does. One format
so far, `hermes` (vLLM's name), which Qwen2.5/Qwen3 and Hermes models write:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`tool_choice: "required"` or a named function is enforced with structured output
(`specdec.decoding.structured_output`): a Lark grammar of the same format whose JSON is constrained to the
functions' names and parameter schemas, so the constrained text is what the model would write
anyway (high acceptance) and goes through the same parser.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from specdec.decoding.structured_output import JSON_LAYOUT, Constraint

#: The tool-call formats this server parses (`--tool-call-parser`).
PARSERS = ("hermes", "none")

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(_OPEN) + r"\s*(.*?)\s*" + re.escape(_CLOSE), re.DOTALL)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(name: str, arguments) -> dict:
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str)
                         else json.dumps(arguments, ensure_ascii=False)}}


def _parse_one(body: str) -> dict | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return _call(value["name"], value.get("arguments", value.get("parameters", {})))


def parse(text: str) -> tuple[str | None, list[dict]]:
    """A whole output -> (content, tool calls). Content is the text outside the calls (None when
    empty); a block that is not a JSON call stays in the content."""
    calls, content, last = [], [], 0
    for match in _CALL.finditer(text):
        call = _parse_one(match.group(1))
        if call is None:
            continue
        content.append(text[last:match.start()])
        calls.append(call)
        last = match.end()
    content.append(text[last:])
    rest = "".join(content).strip() if calls else text
    return (rest or None), calls


@dataclass
class StreamParser:
    """Streamed text -> (content delta, finished tool calls) per chunk. Text that may be the start of
    a `<tool_call>` is held back until it is known; a call is sent whole once its block closes."""

    held: str = ""
    inside: bool = False
    calls: list[dict] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.held += text
        out, done = [], []
        while True:
            if self.inside:
                end = self.held.find(_CLOSE)
                if end < 0:
                    break
                block, self.held = self.held[: end + len(_CLOSE)], self.held[end + len(_CLOSE):]
                call = _parse_one(block[len(_OPEN):-len(_CLOSE)].strip())
                if call is None:
                    out.append(block)
                else:
                    done.append(call)
                self.inside = False
                continue
            start = self.held.find(_OPEN)
            if start >= 0:
                out.append(self.held[:start])
                self.held, self.inside = self.held[start:], True
                continue
            keep = _partial_suffix(self.held, _OPEN)
            out.append(self.held[: len(self.held) - keep])
            self.held = self.held[len(self.held) - keep:]
            break
        self.calls.extend(done)
        content = "".join(out)
        if self.calls and not content.strip():
            content = ""
        return content, done

    def finish(self) -> str:
        """What is still held at the end (an unclosed block stays text)."""
        rest, self.held, self.inside = self.held, "", False
        return rest


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def function_schema(tool: dict) -> dict:
    """The JSON schema of one call of `tool` in the hermes format."""
    fn = tool["function"]
    return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                             "arguments": fn.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def required_constraint(tools: list[dict], parallel: bool) -> Constraint:
    """`tool_choice: required` (or one named tool: pass just it): at least one call (exactly one
    unless `parallel`), each to one of `tools` with arguments matching its parameters."""
    schemas = [function_schema(t) for t in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": JSON_LAYOUT}
    call = f'"{_lark(_OPEN)}" "\\n" body "\\n" "{_lark(_CLOSE)}"'
    start = 'call ("\\n" call)*' if parallel else "call"
    grammar = f"start: {start}\ncall: {call}\nbody: %json {json.dumps(schema)}"
    return Constraint("grammar", grammar)


def _lark(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')
