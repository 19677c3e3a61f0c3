"""`specdec bench`: registered into the core CLI through the `specdec.cli` entry point group."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    return values


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def register(subparsers, generate_parser) -> None:
    from specdec.config import EngineConfig, SamplingParams
    from specdec.models.presets import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdec.options import add_arguments

    p = subparsers.add_parser(
        "bench", help="measure speedups side by side with Hugging Face generate()",
        description="Benchmark specdec against Hugging Face generate(), assisted generation and prompt lookup, "
                    "in one run on the same prompts (HumanEval by default), interleaved prompt by prompt. "
                    "Writes bench.json, bench.md and PNG plots.")
    add_arguments(p, EngineConfig, only=("target", "draft"),
                  defaults={"target": DEFAULT_TARGET, "draft": DEFAULT_DRAFT})
    p.add_argument("--limit", type=int, default=20, help="first N prompts [default: 20]")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help='JSONL of prompts (strings or {"prompt": ...}) instead of HumanEval')
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    add_arguments(p, SamplingParams, only=("max_tokens", "temperature", "top_p", "top_k", "seed"),
                  defaults={"max_tokens": 128})
    p.add_argument("--k-sweep", type=_int_list, default=(1, 2, 4, 6, 8), metavar="K,K,...",
                   help="fixed K values to run; '' for none [default: 1,2,4,6,8]")
    add_arguments(p, EngineConfig, only=("max_speculative_tokens",))
    p.add_argument("--ray-tp", type=_int_list, default=(1, 2), metavar="N,N,...",
                   help="tensor parallel sizes for the Ray engine [default: 1,2]")
    p.add_argument("--ray-placement", type=_name_list, default=("colocated", "separate"), metavar="P,P,...",
                   help="draft placements for the Ray engine: colocated (in the rank-0 target shard) and/or "
                        "separate (its own actor, pipelining off and on) [default: colocated,separate]")
    p.add_argument("--no-ray", action="store_true", help="skip the Ray engine")
    p.add_argument("--no-ngram", action="store_true", help="skip specdec's n-gram (prompt lookup) method")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face methods (baseline: specdec-none)")
    p.add_argument("--concurrency", type=_int_list, default=None, metavar="N,N,...",
                   help="instead: throughput under N concurrent closed-loop clients for each N (batched and "
                        "unbatched specdec, the Ray engine, HF generate() on static batches of N); "
                        "writes bench-concurrency.json/.md and throughput_vs_concurrency.png")
    p.add_argument("--conversations", type=_name_list, default=None, metavar="W,W,...",
                   help="instead: multi-turn workloads (chat: a shared system prompt and four turns; agent: tool "
                        "definitions and four tool-result steps; misses: single prompts that never hit), each turn "
                        "on an engine with prefix caching and one without, interleaved; time to first token per "
                        "turn; writes bench-conversations.json/.md and ttft_per_turn.png")
    p.add_argument("--num-conversations", type=int, default=3, metavar="N",
                   help="conversations per --conversations workload (their first turns come from the prompts) "
                        "[default: 3]")
    p.add_argument("--precisions", type=_name_list, default=(), metavar="P,P,...",
                   help="also run auto K with the draft fixed at each precision (none, bfloat16, int8, int8-weight) "
                        "[default: none of them; specdec-auto uses --draft-precision auto]")
    p.add_argument("--target-precisions", type=_name_list, default=(), metavar="P,P,...",
                   help="also run the target at each precision (int4, int8-weight): target-only and auto K, "
                        "the auto row paired with its target-only row [default: float32 only]")
    p.add_argument("--draft-vocabs", type=_int_list, default=(), metavar="N,N,...",
                   help="also run the bfloat16 draft over the N most frequent tokens, for each N (FR-Spec)")
    p.add_argument("--prompt-lookup-mins", type=_int_list, default=(), metavar="N,N,...",
                   help="also run the bfloat16 draft behind prompt lookup (matches of N+ tokens), for each N")
    p.add_argument("--sampling-modes", type=_name_list, default=(), metavar="M,M,...",
                   help="also run specdec-auto in each sampling mode (invariant, residual) on the same prompts "
                        "(with --temperature > 0) [default: the default mode only]")
    p.add_argument("--hopeless", type=int, default=0, metavar="N",
                   help="also run a random-init draft of the draft's shape against target-only on the first N "
                        "prompts [default: 0 = skip]")
    p.add_argument("--no-prompt-lookup", action="store_true", help="skip HF's prompt lookup method")
    add_arguments(p, EngineConfig, only=("num_threads",))
    p.add_argument("--out", default=None, help="output directory [default: bench-results/<time>]")
    p.set_defaults(func=cmd_bench)


def _prompts_and_sampling(args: argparse.Namespace):
    """The run's prompts, sampling parameters and output directory, checked."""
    from benchmarks import prompts as prompt_sources
    from specdec.config import SamplingParams
    from specdec.options import from_args

    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    sampling = SamplingParams(**from_args(SamplingParams, args))
    if args.prompts:
        prompts, source = prompt_sources.from_jsonl(args.prompts, args.limit), args.prompts
    else:
        prompts, source = prompt_sources.humaneval(args.limit), "HumanEval"
    return prompts, source, sampling, Path(args.out or f"bench-results/{time.strftime('%Y%m%d-%H%M%S')}")


def bench_config_from_args(args: argparse.Namespace):
    """The benchmark the flags describe, checked, with no model loaded: a `BenchConfig`, or with
    --concurrency the concurrency run's (concurrencies, prompts, sampling, output directory), with
    --conversations the conversation run's (workloads, prompts, sampling, output directory)."""
    from benchmarks.runner import BenchConfig, check_ray_placements

    check_ray_placements(args.ray_placement)
    prompts, source, sampling, out = _prompts_and_sampling(args)
    if args.conversations is not None:
        from benchmarks.conversations import WORKLOADS

        unknown = [w for w in args.conversations if w not in WORKLOADS]
        if not args.conversations or unknown:
            raise ValueError(f"--conversations takes {', '.join(WORKLOADS)}; got {','.join(unknown) or 'none'}")
        if args.num_conversations < 1:
            raise ValueError(f"--num-conversations must be >= 1, got {args.num_conversations}")
        if args.concurrency is not None:
            raise ValueError("--conversations and --concurrency are separate runs; pass one of them")
        return tuple(args.conversations), prompts, sampling, out
    if args.concurrency is not None:
        if not args.concurrency or any(n < 1 for n in args.concurrency):
            raise ValueError(f"--concurrency needs integers >= 1, got {','.join(map(str, args.concurrency)) or 'none'}")
        return tuple(args.concurrency), prompts, sampling, out
    return BenchConfig(target=args.target, draft=args.draft, prompts=tuple(prompts), prompts_source=source,
                       sampling=sampling, k_sweep=args.k_sweep, max_speculative_tokens=args.max_speculative_tokens,
                       hf=not args.no_hf, ray_tps=() if args.no_ray else args.ray_tp,
                       ray_placements=args.ray_placement, ngram=not args.no_ngram, num_threads=args.num_threads,
                       chat=args.chat, precisions=args.precisions, target_precisions=args.target_precisions,
                       draft_vocabs=args.draft_vocabs,
                       prompt_lookup_mins=args.prompt_lookup_mins, hopeless=args.hopeless,
                       sampling_modes=args.sampling_modes, hf_prompt_lookup=not args.no_prompt_lookup, out_dir=out)


def cmd_bench(args: argparse.Namespace) -> int:
    from benchmarks.runner import run

    config = bench_config_from_args(args)
    if args.conversations is not None:
        return _conversations(args, *config)
    if args.concurrency is not None:
        return _concurrency(args, *config)
    rows, paths = run(config)
    print(paths["markdown"].read_text())
    print("written: " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


def _concurrency(args: argparse.Namespace, concurrencies: tuple[int, ...], prompts, sampling, out: Path) -> int:
    from benchmarks import concurrency
    from specdec.models.loading import load_tokenizer
    from specdec.engine.prompt import check_prompt, tokenize_prompt

    tokenizer = load_tokenizer(args.target)
    ids = [check_prompt(tokenize_prompt(tokenizer, p.text, args.chat), sampling, len(tokenizer), 1 << 30)
           for p in prompts]
    rows, paths = concurrency.run(args.target, args.draft, ids, sampling, concurrencies, out,
                                  max_speculative_tokens=args.max_speculative_tokens, num_threads=args.num_threads,
                                  ray=not args.no_ray, hf=not args.no_hf,
                                  command="specdec " + " ".join(sys.argv[1:]))
    print(paths["markdown"].read_text())
    print("written: " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


def _conversations(args: argparse.Namespace, workloads: tuple[str, ...], prompts, sampling, out: Path) -> int:
    from benchmarks import conversations

    rows, paths = conversations.run(args.target, args.draft, workloads, args.num_conversations, sampling, out,
                                    prompts, num_threads=args.num_threads, command="specdec " + " ".join(sys.argv[1:]))
    print(paths["markdown"].read_text())
    print("written: " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0
