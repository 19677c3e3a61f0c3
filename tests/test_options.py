"""Every option has one definition (a config dataclass field); the command lines and `specdec
serve`'s options are derived from it, with the same names, defaults and checks."""

import argparse
import dataclasses

import pytest

from actors.config import RayEngineConfig
from deployments.config import SERVING_OPTIONS, ServeOptions
from specdec.cli import build_parser
from specdec.config import EngineConfig, SamplingParams
from specdec.options import ConfigError, flag_of, options


def _actions(*command) -> dict[str, argparse.Action]:
    parser = build_parser()
    for name in command:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return {a.dest: a for a in parser._actions if a.help != argparse.SUPPRESS}  # not the renamed spellings


CLI_DEFAULTS = {"target": "qwen2.5-coder-1.5b-instruct", "draft": None}  # the preset pair; its suggested draft


@pytest.mark.parametrize("command", [("generate",), ("serve",), ("models", "calibrate")])
def test_every_engine_option_is_a_flag_with_the_fields_name_and_default(command):
    actions = _actions(*command)
    for f in options(EngineConfig):
        if not f.metadata["option"]["cli"]:
            assert f.name not in actions
            continue
        action = actions[f.name]
        default = None if f.default is dataclasses.MISSING else f.default  # target: required in the core
        flag = flag_of(f.name)
        if default is True:  # a switch that is on: its flag turns it off
            flag = "--no-" + flag.removeprefix("--")
        assert flag in action.option_strings, f.name
        assert action.default == CLI_DEFAULTS.get(f.name, default), f.name
        assert action.help.removeprefix("turn off: ").startswith(f.metadata["option"]["help"][:40]), f.name


def test_sampling_and_ray_options_are_flags_of_generate():
    actions = _actions("generate")
    for f in [*options(SamplingParams), *options(RayEngineConfig)]:
        if f.metadata["option"]["cli"]:
            assert f.name in actions, f.name
    assert actions["tp"].default is None  # generate runs in process unless --tp is given
    assert _actions("serve")["tp"].default == 1


def test_serve_options_are_the_engine_fields_and_the_serving_fields():
    fields = ServeOptions.model_fields
    batch = {"max_batch_size", "max_batch_tokens"}  # a replica's batch follows max_ongoing_requests
    for f in [*options(EngineConfig), *options(RayEngineConfig)]:
        if f.name in batch:
            assert f.name not in fields
            continue
        assert fields[f.name].description == f.metadata["option"]["help"], f.name
    assert set(fields) == {f.name for f in options(EngineConfig) if f.name not in batch} \
        | {f.name for f in options(RayEngineConfig)} | set(SERVING_OPTIONS)
    serve = _actions("serve")
    for name in SERVING_OPTIONS:
        assert flag_of(name) in serve[name].option_strings, name


def test_one_check_names_the_field_everywhere(tmp_path):
    with pytest.raises(ConfigError) as e:
        EngineConfig(target="t", num_speculative_tokens=0)
    assert e.value.field == "num_speculative_tokens"
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1 or 'auto'"):
        ServeOptions(target=str(tmp_path), draft="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="max_speculative_tokens must be at most 64"):
        ServeOptions(target=str(tmp_path), draft="ngram", num_speculative_tokens="auto", max_speculative_tokens=65)
    with pytest.raises(ValueError, match="target_role.cpus"):  # a role's unknown key is refused by name
        ServeOptions(target=str(tmp_path), draft="ngram", target_role={"cpus": 1})
    options_ = ServeOptions(target=str(tmp_path), draft="ngram", num_speculative_tokens="auto", tp=1)
    assert options_.ray_engine_config().engine.auto_k
