"""One definition per option, and the interfaces derived from it.

An option is a field of a frozen config dataclass (`EngineConfig`, `SamplingParams`, the actors'
`RayEngineConfig`): its name, type and default are the field's, its help text and command-line form
are the field's metadata (`option(...)`), and its validation is the dataclass's `__post_init__`,
which raises `ConfigError` naming the field. From these:
- `add_arguments` makes the argparse flags (`specdec generate`, `serve`, `bench`): `--name-with-dashes`;
- `from_args` reads them back into the dataclass's keyword arguments;
- `pydantic_fields` makes the fields of a pydantic model (`specdec serve`'s `ServeOptions`, the
  `args` of a Serve config file) with the same names, defaults and descriptions;
- `flag_of` names the flag a `ConfigError` is about;
- `RENAMED` keeps the names options had before 0.1.0 working for one release, with a warning:
  `add_renamed_flags` on the command line, `renamed_keys` in `specdec serve`'s options and config files.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import MISSING, field

#: The metadata key that marks a dataclass field as a user-facing option.
_KEY = "option"


class ConfigError(ValueError):
    """A bad option value: `field` is the dataclass field (the flag is `flag_of(field)`)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


def option(default=MISSING, *, help: str, default_factory=MISSING, short: str | None = None,
           flag: str | None = None, metavar: str | None = None, choices: tuple | None = None,
           parse=None, append: bool = False, cli: bool = True):
    """A dataclass field that is a user-facing option.

    `parse` turns one command-line string into the value (argparse `type`); `append` makes a
    repeatable flag whose values form a tuple; `cli=False` keeps an option out of the command line
    (it is still a `ServeOptions` field when asked for)."""
    meta = {_KEY: dict(help=help, short=short, flag=flag, metavar=metavar, choices=choices, parse=parse,
                       append=append, cli=cli)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def options(cls, only=None, exclude=()) -> list[dataclasses.Field]:
    """The option fields of `cls`, in declaration order (or in `only`'s order)."""
    found = {f.name: f for f in dataclasses.fields(cls) if _KEY in f.metadata}
    names = only if only is not None else [n for n in found if n not in exclude]
    return [found[n] for n in names]


def flag_of(name: str) -> str:
    """The command-line flag of option `name`."""
    return "--" + name.replace("_", "-")


def _flag(f: dataclasses.Field) -> str:
    return f.metadata[_KEY]["flag"] or flag_of(f.name)


def _default(f: dataclasses.Field):
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None if f.default is MISSING else f.default


def _scalar(tp):
    """int, float, str or bool from an annotation such as `int | None`."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    return args[0] if len(args) == 1 else str


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def add_arguments(group, cls, only=None, exclude=(), defaults: dict | None = None) -> None:
    """Add a flag for each option field of `cls` to an argparse parser or group. `defaults` overrides
    a field's default for this command only (the help says which default applies)."""
    defaults = defaults or {}
    hints = typing.get_type_hints(cls)
    for f in options(cls, only, exclude):
        meta = f.metadata[_KEY]
        if not meta["cli"]:
            continue
        default = defaults.get(f.name, _default(f))
        names = [n for n in (meta["short"], _flag(f)) if n]
        kwargs = dict(dest=f.name, help=meta["help"])
        scalar = _scalar(hints[f.name])
        if scalar is bool and not meta["append"]:
            if default:
                kwargs["help"] = "turn off: " + kwargs["help"]
                group.add_argument("--no-" + _flag(f).removeprefix("--"), action="store_false", **kwargs)
            else:
                group.add_argument(*names, action="store_true", **kwargs)
            continue
        if meta["append"]:
            kwargs.update(action="append", default=[])
            scalar = typing.get_args(_scalar_tuple(hints[f.name]))[0]
        else:
            kwargs["default"] = default
            if default not in (None, "", ()) and not isinstance(default, bool):
                kwargs["help"] += f" [default: {default}]"
        kwargs["type"] = meta["parse"] or {int: integer, float: float}.get(scalar, str)
        if meta["choices"]:
            kwargs["choices"] = list(meta["choices"])
        if meta["metavar"]:
            kwargs["metavar"] = meta["metavar"]
        group.add_argument(*names, **kwargs)


def _scalar_tuple(tp):
    """tuple[int, ...] from `tuple[int, ...]` or `tuple[int, ...] | None`."""
    for a in typing.get_args(tp) or (tp,):
        if typing.get_origin(a) is tuple:
            return a
    return tuple[str, ...]


def from_args(cls, args: argparse.Namespace, only=None, exclude=()) -> dict:
    """The option values `add_arguments` parsed, as keyword arguments of `cls`."""
    values = {}
    for f in options(cls, only, exclude):
        if f.metadata[_KEY]["cli"] and hasattr(args, f.name):
            value = getattr(args, f.name)
            values[f.name] = tuple(value) if f.metadata[_KEY]["append"] else value
    return values


def pydantic_fields(cls, only=None, exclude=(), defaults: dict | None = None) -> dict:
    """`pydantic.create_model` field definitions for the option fields of `cls`: same names, types,
    defaults and descriptions; a field with choices is a Literal (listed in the JSON schema)."""
    from pydantic import Field

    defaults = defaults or {}
    hints = typing.get_type_hints(cls)
    out = {}
    for f in options(cls, only, exclude):
        meta = f.metadata[_KEY]
        tp = hints[f.name]
        if meta["choices"]:
            tp = typing.Literal[tuple(meta["choices"])]
        default = defaults.get(f.name, _default(f))
        if default is None and type(None) not in typing.get_args(tp):
            tp = tp | None  # an overridden default of None means "unset" (the draft: the preset's suggestion)
        out[f.name] = (tp, Field(default, description=meta["help"]))
    return out


def cli_error(error: ConfigError) -> str:
    """A `ConfigError` as the command line says it: the flag, then the problem."""
    flag, text = flag_of(error.field), str(error)
    return text.replace(error.field, flag, 1) if error.field in text else f"{flag}: {text}"


#: Options renamed in 0.1.0 (one name per concept), old name -> new; the old spellings still work,
#: with a warning, until the next release (docs/cli.md#renamed-options lists them).
RENAMED = {
    "k": "num_speculative_tokens",
    "max_k": "max_speculative_tokens",
    "threads": "num_threads",
    "draft_quantization": "draft_precision",
    "draft_vocab": "draft_vocab_size",
    "ngram_first": "prompt_lookup_min",
    "request_timeout": "request_timeout_s",
}


def deprecation(old: str, new: str) -> str:
    return f"{old} is deprecated: it was renamed {new}, and the old name goes in the next release"


class _RenamedFlag(argparse.Action):
    """An old spelling of a flag: sets the new flag's value, with a warning on stderr."""

    def __init__(self, option_strings, dest, new_flag: str, **kwargs) -> None:
        self.new_flag = new_flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import sys

        print(f"{parser.prog}: warning: {deprecation(option_string, self.new_flag)}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_renamed_flags(parser: argparse.ArgumentParser) -> None:
    """Accept each `RENAMED` flag's old spelling where its new one exists (bench's list-valued forms
    too: `--prompt-lookup-mins`), in `parser` and every subcommand; hidden from --help."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                add_renamed_flags(sub)
    known = parser._option_string_actions
    for old, new in RENAMED.items():
        old_flag = flag_of(old)
        target = known.get(flag_of(new)) or known.get(flag_of(new) + "s")
        if target is None or old_flag in known or not isinstance(target, argparse._StoreAction):
            continue
        parser.add_argument(old_flag, dest=target.dest, type=target.type, choices=target.choices,
                            metavar=target.metavar, nargs=target.nargs, help=argparse.SUPPRESS,
                            action=_RenamedFlag, new_flag=target.option_strings[-1])


def renamed_keys(values: dict, warn) -> dict:
    """`values` (options by name, e.g. a Serve config file's `args`) with `RENAMED` keys under their
    new names; `warn(message)` is told of each. An old and a new name both given is an error."""
    out = dict(values)
    for old, new in RENAMED.items():
        if old in out:
            if new in out:
                raise ValueError(f"{old} and {new} are both given: {old} is the old name of {new}; keep {new}")
            out[new] = out.pop(old)
            warn(deprecation(old, new))
    return out
