"""The README and docs, literally, as tests: every `specdec` command line they show is parsed by the
real command line and builds the options that command would build, with no model loaded (a bad
default fails here in seconds, as the README's own `specdec serve` once did while CI stayed green);
every flag they name exists in `--help`; the README's two commands run for real under `-m slow`."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deployments.processes import read_line
from tests.test_docs import PAGES, ROOT

#: Flags the pages name that belong to other programs, with the program.
FOREIGN_FLAGS = {"--metrics-export-port": "ray start", "--resources": "ray start", "--pdb": "pytest"}
#: A synopsis names placeholders (`--limit N`, `pull NAME`) or alternatives (`[--force]`, `a|b`).
PLACEHOLDER = re.compile(r"\[|\||\.\.\.|(?<![\w-])[A-Z][A-Z_]*(?![\w-])")


def _fenced_commands(text: str) -> list[str]:
    """`specdec ...` lines of fenced code blocks, with their indented continuation lines."""
    commands: list[str] = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.splitlines():
            bare = line.removeprefix("$ ")
            if bare.startswith("specdec "):
                commands.append(bare)
            elif commands and line.startswith(" ") and line.strip().startswith(("[", "PROMPT")) \
                    and commands[-1] is not None:
                commands[-1] += " " + line.strip()
            else:
                commands.append(None)
    return [c.split("  #")[0].strip() for c in commands if c]


def _inline_code(text: str) -> list[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", text)


def doc_commands() -> list[tuple[str, str, bool]]:
    """(page, command, fenced) for every `specdec` command the pages show: whole command lines in
    fenced code blocks, and mentions in inline code (`specdec generate --json` names a flag; it is
    not a command line to run)."""
    found = []
    for page in PAGES:
        text = page.read_text()
        name = str(page.relative_to(ROOT))
        found += [(name, c, True) for c in _fenced_commands(text)]
        found += [(name, c, False) for c in _inline_code(text) if c.startswith("specdec ")]
    return list(dict.fromkeys(found))


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _parser_of(parser, words: list[str]) -> argparse.ArgumentParser:
    """The (sub)command parser a command line's leading words select."""
    for word in words:
        sub = _subparsers(parser)
        if word not in sub:
            break
        parser = sub[word]
    return parser


def _all_flags(parser) -> dict[str, argparse.Action]:
    flags = dict(parser._option_string_actions)
    for sub in _subparsers(parser).values():
        flags.update(_all_flags(sub))
    return flags


def build_options(argv: list[str]):
    """What the command builds before it loads any model: the options and configs it runs with."""
    from actors.cli import ray_options
    from actors.config import RayEngineConfig
    from specdec.cli import build_parser, engine_config_from_args, sampling_from_args

    args = build_parser().parse_args(argv)
    if args.command == "generate":
        sampling = sampling_from_args(args)
        config = engine_config_from_args(args)
        ray = RayEngineConfig(engine=config, **ray_options(args)) if args.tp is not None else None
        return sampling, config, ray
    if args.command == "serve":
        from deployments.cli import options_from_args

        return options_from_args(args)
    if args.command == "bench":
        from benchmarks.cli import bench_config_from_args

        return bench_config_from_args(args)
    if args.command == "models" and args.models_command == "calibrate":
        return engine_config_from_args(args)
    return args


COMMANDS = doc_commands()
#: Whole command lines, to parse and build; the rest (synopses, mentions) have their flags checked.
CONCRETE = [(page, c) for page, c, fenced in COMMANDS if fenced and not PLACEHOLDER.search(c.removeprefix("specdec "))]
SYNOPSES = [(page, c) for page, c, _ in COMMANDS if (page, c) not in CONCRETE]


def test_the_pages_show_the_commands_this_test_is_about():
    """The extraction finds what the pages hold (else every test below would pass on nothing)."""
    assert ("README.md", "specdec serve") in CONCRETE
    assert any(c.startswith("specdec bench --prompts") for _, c in CONCRETE)
    assert any(c.startswith("specdec generate [--target MODEL]") for _, c in SYNOPSES)
    assert ("docs/distributed.md", 'specdec generate --tp 2 --target qwen2.5-coder-1.5b-instruct "def quicksort(xs):"') \
        in CONCRETE
    assert len(CONCRETE) >= 6 and len(SYNOPSES) >= 6


@pytest.mark.parametrize("page,command", CONCRETE, ids=[f"{p}: {c}" for p, c in CONCRETE])
def test_every_command_the_pages_show_builds_its_options(page, command, capsys, tmp_path, monkeypatch):
    words = shlex.split(command)[1:]
    monkeypatch.chdir(tmp_path)  # a prompts file the command names is the user's: one prompt here
    if "--prompts" in words:
        (tmp_path / words[words.index("--prompts") + 1]).write_text('{"prompt": "def f():"}\n')
    try:
        build_options(words)
    except SystemExit as e:  # argparse: an unknown flag or a bad value
        pytest.fail(f"{page}: `{command}` exits {e.code}: {capsys.readouterr().err.strip()}")
    assert "deprecated" not in capsys.readouterr().err, f"{page} shows a renamed flag: {command}"


def test_the_readmes_bare_specdec_serve_uses_the_presets_suggested_draft():
    """The bug the README's first command hit: `--draft` unset reached the options as None."""
    options = build_options(["serve"])
    assert options.target == "qwen2.5-coder-1.5b-instruct" and options.draft == "qwen2.5-coder-0.5b-instruct"
    assert options.ray_engine_config().engine.draft == options.draft


def test_a_bad_default_is_caught(monkeypatch):
    """The negative control: with the old definition (the draft typed `str`, default None passed
    explicitly) building the bare command's options fails, as it did for users."""
    import specdec.options

    original = specdec.options.pydantic_fields

    def strict(cls, only=None, exclude=(), defaults=None):
        from pydantic import Field

        fields = original(cls, only, exclude, defaults)
        if "draft" in fields:
            fields["draft"] = (str, Field(None))
        return fields

    monkeypatch.setattr(specdec.options, "pydantic_fields", strict)
    from pydantic import create_model

    import deployments.config as dc

    broken = create_model("ServeOptions", __base__=dc._Serving,
                          **specdec.options.pydantic_fields(dc.EngineConfig, exclude=dc._BATCH,
                                                            defaults={"target": dc.DEFAULT_TARGET, "draft": None}),
                          **specdec.options.pydantic_fields(dc.RayEngineConfig))
    monkeypatch.setattr(dc, "ServeOptions", broken)
    with pytest.raises(Exception, match="draft"):
        build_options(["serve"])


@pytest.mark.parametrize("page,command", SYNOPSES, ids=[f"{p}: {c[:60]}" for p, c in SYNOPSES])
def test_every_flag_of_a_synopsis_exists_with_the_values_it_lists(page, command):
    from specdec.cli import build_parser

    parser = build_parser()
    words = command.split()[1:]
    scope = _all_flags(_parser_of(parser, words[:1]))  # the command and its actions (`models pull`)
    for flag, values in re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)(?:[ =]([a-z0-9][\w.-]*(?:\|[\w.-]+)+))?",
                                   command.removeprefix("specdec ")):
        assert flag in scope, f"{page}: `{command}` names {flag}, which `specdec {words[0]}` does not take"
        choices = scope[flag].choices
        if values and choices:
            listed = set(values.split("|"))
            assert listed <= set(choices), f"{page}: {flag} lists {sorted(listed - set(choices))}, not choices"


def unknown_flags(text: str) -> list[str]:
    """Flags a page names in inline code (`--request-timeout-s`, `specdec generate --json`) that no
    `specdec` command takes and no other program owns (FOREIGN_FLAGS); a renamed spelling counts as
    unknown outside the changelog (a "## Renamed options" section)."""
    from specdec.cli import build_parser
    from specdec.options import RENAMED, flag_of

    known = {f for f, a in _all_flags(build_parser()).items() if a.help != argparse.SUPPRESS}
    old = {flag_of(name) for name in RENAMED}
    text = re.sub(r"^## Renamed options\n.*?(?=^## |\Z)", "", text, flags=re.S | re.M)  # the changelog
    unknown = []
    for code in _inline_code(text):
        if not code.startswith(("specdec ", "-")):
            continue  # another program's command line (`ray start ...`, `python -m pytest ...`)
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", code):
            if flag in old or flag not in known | set(FOREIGN_FLAGS):
                unknown.append(flag)
    return unknown


def test_every_flag_the_pages_name_is_in_help():
    assert {str(p.relative_to(ROOT)): unknown_flags(p.read_text()) for p in PAGES} == \
        {str(p.relative_to(ROOT)): [] for p in PAGES}


def test_an_unknown_or_renamed_flag_in_a_page_is_caught():
    """The negative control: a made-up flag and an old spelling outside the changelog are reported."""
    page = ("Use `--request-timeout-s` and `specdec generate --json`, not `--made-up` or `--k 3`.\n"
            "## Renamed options\n`--k` is now `-k`.\n## Next\n`--threads 2`\n")
    assert unknown_flags(page) == ["--made-up", "--k", "--threads"]


def test_every_renamed_flag_still_works_with_a_warning(capsys):
    from specdec.cli import build_parser
    from specdec.options import RENAMED, flag_of

    parser = build_parser()
    args = parser.parse_args(["generate", "--k", "3", "--max-k", "6", "--threads", "1", "--draft-quantization",
                              "int8-weight", "--draft-vocab", "1000", "--ngram-first", "2", "x"])
    assert (args.num_speculative_tokens, args.max_speculative_tokens, args.num_threads, args.draft_precision,
            args.draft_vocab_size, args.prompt_lookup_min) == (3, 6, 1, "int8-weight", 1000, 2)
    assert parser.parse_args(["serve", "--request-timeout", "5"]).request_timeout_s == 5.0
    assert parser.parse_args(["bench", "--ngram-first", "2,3"]).prompt_lookup_mins == (2, 3)
    err = capsys.readouterr().err
    for old, new in RENAMED.items():
        assert f"{flag_of(old)} is deprecated: it was renamed" in err, old
    assert "--ngram-first is deprecated: it was renamed --prompt-lookup-mins" in err
    with pytest.raises(SystemExit):  # a renamed flag's old value checks still apply
        parser.parse_args(["generate", "--draft-quantization", "int3", "x"])


def test_a_config_file_with_the_old_option_names_still_works(tmp_path, caplog):
    from deployments.config import ServeOptions

    options = ServeOptions(target=str(tmp_path), draft="ngram", k=3, max_k=5, threads=1, ngram_first=2)
    assert (options.num_speculative_tokens, options.max_speculative_tokens, options.num_threads,
            options.prompt_lookup_min) == (3, 5, 1, 2)
    assert "k is deprecated: it was renamed num_speculative_tokens" in caplog.text
    with pytest.raises(ValueError, match="k and num_speculative_tokens are both given"):
        ServeOptions(target=str(tmp_path), draft="ngram", k=3, num_speculative_tokens=4)


README_FIRST_REQUEST = re.compile(r"```bash\n(curl -s http://127.0.0.1:8000.*?)\n```", re.S)


@pytest.mark.slow
def test_the_readmes_two_commands_serve_the_default_pair_and_answer_its_curl(tmp_path):
    """The README's `specdec serve`, exactly as written (no flags: the embedded Qwen pair on port 8000),
    until its ready line, then the README's own curl request."""
    specdec = str(Path(sys.executable).with_name("specdec"))
    proc = subprocess.Popen([specdec, "serve"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = read_line(proc.stdout, timeout_s=1800)  # a first run pulls ~1.6 GB and converts it
        assert base is not None and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else "slow"
        assert base.strip() == "http://127.0.0.1:8000/v1"
        curl = README_FIRST_REQUEST.search((ROOT / "README.md").read_text()).group(1)
        out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=600)
        answer = __import__("json").loads(out.stdout)
        assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] > 0, out.stdout
        print(f"\nREADME request: {answer['usage']}, acceptance {answer['speculative']['acceptance_rate']:.2f}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
