"""`specdec generate --tp N`: the command line's distributed mode, registered as a CLI plugin (entry
point group `specdec.cli`) so the Ray-free core never imports this layer."""

from __future__ import annotations

import argparse

from actors.config import DRAFT_PLACEMENTS


def register(subparsers, generate_parser: argparse.ArgumentParser) -> None:
    g = generate_parser.add_argument_group("distributed (Ray)")
    g.add_argument("--tp", type=int, default=None, metavar="N",
                   help="run on Ray: N tensor-parallel target shards, a draft worker and a coordinator "
                        "(joins $RAY_ADDRESS, else starts a local Ray)")
    g.add_argument("--draft-placement", choices=DRAFT_PLACEMENTS, default="auto",
                   help="with --tp: run the draft inside the rank-0 target shard (colocated) or in its own actor "
                        "(separate); auto colocates on CPU-only nodes, where both would share the cores "
                        "[default: auto]")
    g.add_argument("--no-pipeline", action="store_true",
                   help="with --tp and a separate draft: do not pre-draft the next block while the target verifies")
    g.add_argument("--ray-address", default=None, help="with --tp: the Ray cluster to join [default: $RAY_ADDRESS]")
    generate_parser.set_defaults(make_engine=make_engine)


def make_engine(config, args: argparse.Namespace):
    """The Ray engine when --tp is given, else None (the in-process engine is used)."""
    if args.tp is None:
        return None
    import torch

    from actors.builder import build_ray_engine
    from actors.config import RayEngineConfig, RolePlacement

    gpus = 1.0 if (config.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda") else 0.0
    threads = config.num_threads or 1
    role = RolePlacement(num_cpus=0.5 if not gpus else 1.0, num_gpus=gpus, num_threads=threads)
    ray_config = RayEngineConfig(engine=config, tp_size=args.tp, pipeline=not args.no_pipeline, draft=role,
                                 target=role, draft_placement=args.draft_placement)
    return build_ray_engine(ray_config, address=args.ray_address)
