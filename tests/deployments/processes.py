"""Helpers for tests that start servers: a free local port, a line from a child's output with a bound,
serve.yaml's app builder and arguments, an ASGI app on a real HTTP server in a thread."""

from __future__ import annotations

import contextlib
import importlib
import queue
import socket
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_line(stream, timeout_s: float) -> str | None:
    """The next line of `stream`, or None if none comes within `timeout_s` (a child that hangs)."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout_s)
    except queue.Empty:
        return None


def serve_yaml_app():
    """(the app builder, its args) of deployments/serve.yaml's one application, as `serve run` reads them."""
    config = yaml.safe_load((ROOT / "deployments" / "serve.yaml").read_text())
    (app,) = config["applications"]
    module, _, name = app["import_path"].partition(":")
    return getattr(importlib.import_module(module), name), dict(app["args"])


@contextlib.contextmanager
def http_server(app):
    """`app` on a real HTTP server (uvicorn, as Serve's proxy runs it) in a thread of this process; its port."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the HTTP server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)
