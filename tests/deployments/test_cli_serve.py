"""`specdec serve` as a user runs it: a subprocess that starts its own Ray and Serve, prints the base
URL once /health is 200, answers the `openai` client, and shuts everything down on SIGTERM."""

from __future__ import annotations

import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SPECDEC = str(Path(sys.executable).with_name("specdec"))  # the console script, as a user runs it


def _serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([SPECDEC, "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _read_line(stream, timeout_s: float) -> str | None:
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout_s)
    except queue.Empty:
        return None


def test_specdec_serve_starts_answers_and_stops_on_sigterm(tiny_chat_llama):
    port = _free_port()
    proc = _serve("--target", str(tiny_chat_llama), "--draft", "ngram", "--port", str(port), "--threads", "1",
                  "--api-key", "secret", "--served-model-name", "tiny", "--replicas", "2")
    try:
        line = _read_line(proc.stdout, timeout_s=240)
        assert line is not None and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else ""
        assert line.strip() == f"http://127.0.0.1:{port}/v1"
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        client = openai.OpenAI(base_url=line.strip(), api_key="secret", max_retries=0)
        assert client.models.list().data[0].model_extra["specdec"]["replicas"] == 2
        outs = [None] * 4

        def run(i):
            outs[i] = client.completions.create(model="tiny", prompt="w5 w6 w7 w5 w6 w7 w5", max_tokens=16,
                                                temperature=0)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert len({o.choices[0].text for o in outs}) == 1  # both engines give the same greedy text
        assert all(o.usage.completion_tokens == 16 and "speculative" in o.model_extra for o in outs)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
        err = proc.stderr.read()
        assert "ready in" in err and "shutting down" in err
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("args, words", [
    (["--target", "/no/such/model"], "does not exist"),
    (["--k", "0"], "--k"),
    (["--tp", "0"], "--tp"),
    (["--port", "70000"], "--port"),
    (["--replicas", "0"], "--replicas"),
    (["--request-timeout", "0"], "--request-timeout"),
])
def test_specdec_serve_rejects_bad_options_with_exit_2(tiny_chat_llama, args, words):
    base = ["--target", str(tiny_chat_llama), "--draft", "ngram"]
    started = time.monotonic()
    proc = subprocess.run([SPECDEC, "serve", *base, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr
    assert time.monotonic() - started < 60  # fails before starting Ray
