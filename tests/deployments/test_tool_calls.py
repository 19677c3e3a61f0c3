"""The hermes tool-call parser (Qwen2.5/Qwen3/Hermes `<tool_call>` blocks), whole and streamed."""

from __future__ import annotations

import json

import pytest

from deployments.tool_calls import StreamParser, parse

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
TEXTS = {
    "one call": (CALL_A, None, [("get_weather", {"city": "Paris", "days": 3})]),
    "two calls": (CALL_A + "\n" + CALL_B, None, [("get_weather", {"city": "Paris", "days": 3}),
                                                ("get_time", {"zone": "UTC"})]),
    "text then call": ("Let me check.\n" + CALL_B, "Let me check.", [("get_time", {"zone": "UTC"})]),
    "no call": ("The weather is <b>fine</b> < tool_call >", "The weather is <b>fine</b> < tool_call >", []),
    "broken json stays text": ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    "unclosed stays text": ('<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),
}


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("name", TEXTS)
def test_parse(name):
    text, content, calls = TEXTS[name]
    got_content, got_calls = parse(text)
    assert got_content == content and _calls(got_calls) == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)


@pytest.mark.parametrize("name", TEXTS)
def test_streamed_in_every_split_gives_the_same(name):
    text, _, calls = TEXTS[name]
    whole_content, _ = parse(text)
    for size in (1, 2, 3, 7, len(text)):
        parser, content, got = StreamParser(), "", []
        for i in range(0, len(text), size):
            delta, done = parser.feed(text[i:i + size])
            content += delta
            got += done
        content += parser.finish()
        assert _calls(got) == calls
        assert (content.strip() or None) == whole_content, (size, content)
