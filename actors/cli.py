"""`specdec generate --tp N`: the command line's distributed mode, registered as a CLI plugin (entry
point group `specdec.cli`) so the Ray-free core never imports this layer."""

from __future__ import annotations

import argparse

from actors.config import RayEngineConfig
from specdec.options import add_arguments, from_args


def add_ray_arguments(group, **defaults) -> None:
    """The distributed engine's options (`RayEngineConfig`'s fields) and the cluster to join."""
    add_arguments(group, RayEngineConfig, defaults=defaults)
    group.add_argument("--ray-address", default=None,
                       help="the Ray cluster to join [default: $RAY_ADDRESS, else a local Ray]")


def ray_options(args: argparse.Namespace) -> dict:
    return from_args(RayEngineConfig, args)


def register(subparsers, generate_parser: argparse.ArgumentParser) -> None:
    g = generate_parser.add_argument_group(
        "distributed (Ray)", "--tp N runs on Ray: N tensor-parallel target shards, a draft and a coordinator "
                             "(without --tp: in this process)")
    add_ray_arguments(g, tp=None)
    generate_parser.set_defaults(make_engine=make_engine)


def make_engine(config, args: argparse.Namespace):
    """The Ray engine when --tp is given, else None (the in-process engine is used)."""
    if args.tp is None:
        return None
    from actors.builder import build_ray_engine

    return build_ray_engine(RayEngineConfig(engine=config, **ray_options(args)), address=args.ray_address)
