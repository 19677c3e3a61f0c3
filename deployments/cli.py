"""`specdec serve`: the OpenAI-compatible HTTP service on Ray Serve, registered as a CLI plugin
(entry point group `specdec.cli`) so the core never imports this layer.

    specdec serve                                   # the embedded default pair on 127.0.0.1:8000
    specdec serve --target DIR --draft ngram --tp 2 --replicas 2 --port 8001 --api-key KEY

Starts a local Ray (or joins $RAY_ADDRESS / --ray-address), pulls preset models with progress bars,
deploys the app, waits until /health answers 200, prints the base URL, and on Ctrl-C or SIGTERM
shuts Serve and every actor down.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

APP_NAME = "specdec"


def register(subparsers, generate_parser: argparse.ArgumentParser) -> None:
    from actors.cli import add_ray_arguments
    from specdec.cli import add_model_arguments

    p = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API (Ray Serve)",
                              description="Serve /v1/completions, /v1/chat/completions and /v1/models, answered by "
                                          "lossless speculative decoding on Ray actors.")
    add_model_arguments(p)
    add_ray_arguments(p.add_argument_group("engine on Ray"))
    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1", help="address to bind [default: 127.0.0.1]")
    h.add_argument("--port", type=int, default=8000, help="[default: 8000]")
    _add_serving_arguments(h)
    m = p.add_argument_group("metrics")
    m.add_argument("--metrics-port", type=int, default=8080, metavar="PORT",
                   help="the local Ray's metrics export port: Prometheus scrapes the engine's specdec_* metrics "
                        "(and Ray's and Serve's) at http://HOST:PORT/metrics (monitoring/prometheus.yml); a "
                        "joined cluster keeps its own [default: 8080]")
    p.add_argument("--plan", action="store_true",
                   help="print where each role of each replica would go on the Ray cluster (--ray-address, else a "
                        "local Ray) and what is missing if it cannot fit, then exit (0: it fits, 1: it does not); "
                        "loads no model")
    p.set_defaults(func=cmd_serve)


def _add_serving_arguments(group) -> None:
    """A flag for each serving option, from its one definition (the fields of `ServeOptions`' base)."""
    import typing

    from deployments.config import SERVING_OPTIONS
    from specdec.options import flag_of, integer

    for name, f in SERVING_OPTIONS.items():
        kinds = [a for a in (typing.get_args(f.annotation) or (f.annotation,)) if a is not type(None)]
        help_text = f.description or ""
        if kinds == [bool]:
            group.add_argument(flag_of(name), dest=name, action="store_true", help=help_text)
            continue
        kwargs = dict(dest=name, default=f.default, help=help_text)
        if typing.get_origin(f.annotation) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(f.annotation))
        else:
            kwargs["type"] = {int: integer, float: float}.get(kinds[0], str)
        if f.default is not None and "[default" not in help_text:
            kwargs["help"] += f" [default: {f.default}]"
        group.add_argument(flag_of(name), **kwargs)


def options_from_args(args: argparse.Namespace):
    from pydantic import ValidationError

    from actors.cli import ray_options
    from deployments.config import ENGINE_OPTIONS, SERVING_OPTIONS, ServeOptions
    from specdec.cli import CliError
    from specdec.options import flag_of

    fields = {name: getattr(args, name) for name in (*ENGINE_OPTIONS, "num_threads", *SERVING_OPTIONS)}
    try:
        options = ServeOptions(**fields, **ray_options(args))
    except ValidationError as e:
        first = e.errors()[0]
        if first["type"] == "config":
            field, message = first["ctx"]["field"], first["ctx"]["message"]
        else:
            field, message = (str(first["loc"][0]) if first["loc"] else ""), first["msg"]
        flag = "--no-pipeline" if field == "pipeline" else flag_of(field) if field else "options"
        message = message.removeprefix("Value error, ")
        raise CliError(message.replace(field, flag, 1) if field and field in message
                       else f"{flag}: {message}") from None
    for flag, port in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if not 1 <= port <= 65535:
            raise CliError(f"{flag} must be in 1..65535, got {port}")
    if args.metrics_port == args.port:
        raise CliError(f"--metrics-port and --port are both {args.port}; give them different ports")
    return options


def cmd_serve(args: argparse.Namespace) -> int:
    from specdec.models.loading import resolve_spec
    from specdec.decoding.proposers import NON_MODEL_DRAFTS

    options = options_from_args(args)
    if args.plan:
        return _print_plan(options, args.ray_address or os.environ.get("RAY_ADDRESS"))
    for spec in (options.target, options.draft):
        if spec not in NON_MODEL_DRAFTS:
            resolve_spec(spec)  # a missing path fails here (exit 2), not in a replica
    started = time.monotonic()
    phases: dict[str, float] = {}  # what the ready line breaks the start-up into

    def phase(name: str, since: float) -> float:
        now = time.monotonic()
        phases[name] = phases.get(name, 0.0) + now - since
        return now

    import ray
    from ray import serve

    from actors.builder import ensure_ray, metrics_export_port, prepare_models
    from deployments.builder import build_app

    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    if not address:
        _check_metrics_exportable(args.metrics_port)  # before the (slow) model pulls
    mark = phase("imports", started)
    prepare_models(options.ray_engine_config())  # pulls presets here, with progress bars
    mark = phase("model cache", mark)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # Serve's INFO lines drown the ready line
    ensure_ray(address, metrics_export_port=args.metrics_port)
    mark = phase("Ray", mark)
    metrics_url = f"http://{_display_host(args.host) if not address else _node_ip()}:{metrics_export_port()}/metrics"
    if address and metrics_export_port() != args.metrics_port:
        _say(f"joined a Ray cluster: its metrics export port is {metrics_export_port()} (--metrics-port applies to "
             "a local Ray only)")
    stop = _install_signal_handlers()  # after ray.init, which installs handlers of its own
    try:
        serve.start(http_options={"host": args.host, "port": args.port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        mark = phase("Serve", mark)
        _say(f"loading {options.target} (draft {options.draft}, K {options.num_speculative_tokens}, tp {options.tp}, "
             f"{options.replicas} replica{'s' if options.replicas > 1 else ''}) ...")
        try:
            serve.run(build_app(options), name=APP_NAME, route_prefix="/",
                      logging_config={"log_level": "WARNING", "enable_access_log": False})
        except RuntimeError as e:
            _say(f"error: the service failed to start: {_last_error_line(e)}")
            return 1
        base = f"http://{_display_host(args.host)}:{args.port}"
        try:
            _wait_healthy(base)
            mark = phase("replicas", mark)
            _wait_metrics(metrics_url)
            phase("metrics", mark)
        except RuntimeError as e:
            _say(f"error: {e}")
            return 1
        stop.serving = True
        _say(f"ready in {time.monotonic() - started:.1f}s: {base}/v1 (model {options.served_model_name!r}"
             f"{', API key required' if options.api_key else ''}), metrics at {metrics_url}; Ctrl-C to stop")
        _say_startup(phases, base, options.api_key.get_secret_value() if options.api_key else None)
        print(f"{base}/v1", flush=True)
        print(metrics_url, flush=True)
        while not stop.wait(1.0):
            pass
        _say("shutting down")
        return 0
    except KeyboardInterrupt:
        _say("interrupted; shutting down")
        return 130
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _print_plan(options, address: str | None) -> int:
    """`--plan`: the replicas' placement on the cluster's free resources, as text; no model loads."""
    import ray

    from actors.builder import ensure_ray
    from actors.placement import cluster_nodes, plan, render

    ensure_ray(address)
    try:
        nodes = cluster_nodes()
        plans = plan(options.ray_engine_config(), nodes, options.replicas)
        print(render(plans, nodes), flush=True)
        return 0 if all(p.fits for p in plans) else 1
    finally:
        if not address:
            ray.shutdown()


def _install_signal_handlers():
    """SIGINT/SIGTERM: interrupt the start-up, or once serving, end the wait for a clean shutdown."""
    import threading

    stop = threading.Event()
    stop.serving = False

    def handler(signum, frame):
        stop.set()
        if not stop.serving:
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def _wait_healthy(base: str, timeout_s: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{base}/health", timeout=10)
            if r.status_code == 200:
                return
            last = r.text
        except httpx.HTTPError as e:
            last = str(e)
        time.sleep(0.5)
    raise RuntimeError(f"{base}/health did not answer 200 within {timeout_s:.0f}s: {last}")


def _check_metrics_exportable(port: int) -> None:
    """A local Ray must be able to export metrics: fail now, naming what is missing."""
    import socket

    from ray._private.utils import get_dashboard_dependency_error

    from specdec.cli import CliError

    missing = get_dashboard_dependency_error()
    if missing is not None:
        raise CliError(f"Ray's metrics agent cannot export metrics with this Ray install ({missing}); "
                       "install Ray's default components: pip install 'ray[serve]'")
    with socket.socket() as s:
        # As a server binds: a connection of the last run still in TIME_WAIT must not fail a restart.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError as e:
            raise CliError(f"--metrics-port {port} is not free ({e.strerror}); another Ray or specdec serve may "
                           "hold it: pick another port") from None


def _wait_metrics(url: str, timeout_s: float = 60.0) -> None:
    """Ray's metrics agent starts after the node; wait until it serves the exposition."""
    import httpx

    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url, timeout=10)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = str(e) or e.__class__.__name__
        time.sleep(0.5)
    raise RuntimeError(f"Ray's metrics agent is not exporting at {url} after {timeout_s:.0f}s ({last}): the "
                       "engine's metrics would reach no Prometheus. Check the agent's log "
                       "(/tmp/ray/session_latest/logs/dashboard_agent.log)")


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _display_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def _last_error_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":")[0]]
    return (errors or lines or ["unknown error"])[-1][:500]


def _say_startup(phases: dict[str, float], base: str, api_key: str | None) -> None:
    """Where the start-up went: this process's phases, then a replica's engine stages (from /v1/models)."""
    import httpx

    from specdec.kernels.calibration import describe
    from specdec.startup import summary

    line = f"start-up: {summary(phases)}"
    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        card = httpx.get(f"{base}/v1/models", headers=headers, timeout=10).json()["data"][0]
        engine, stages = card["specdec"].get("engine_startup_seconds"), card["specdec"].get("startup_seconds")
        if engine is not None:
            line += f"; in the replica: its engine's actors started and loaded in {engine:.1f}s"
        if stages:
            line += f", the target shard's stages: {summary(stages)}"
        calibration = card["specdec"].get("calibration") or {}
        if calibration:
            line += (f"\n[specdec serve] target precision {describe(calibration.get('target_precision'))}; target "
                     f"linear kernel {describe(calibration.get('linear_kernel'))}; draft precision "
                     f"{describe(calibration.get('draft_precision'))}")
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        pass  # the breakdown is a courtesy: never fail a started service over it
    _say(line)


def _say(message: str) -> None:
    print(f"[specdec serve] {message}", file=sys.stderr, flush=True)
