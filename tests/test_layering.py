"""Imports go one way: deployments -> actors -> specdec. The core never imports Ray."""

import os
import subprocess
import sys

import pytest


def test_import_specdec_does_not_import_ray():
    code = "import sys, specdec, specdec.cli, specdec.engine.local; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_core_does_not_import_upper_layers():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "specdec"
    offenders = [str(p) for p in root.rglob("*.py")
                 if any(w in p.read_text() for w in ("import ray", "from ray", "from actors", "import actors",
                                                       "from deployments", "import deployments"))]
    assert offenders == []


def test_actors_do_not_import_deployments():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "actors"
    offenders = [str(p) for p in root.rglob("*.py")
                 if any(w in p.read_text() for w in ("from deployments", "import deployments"))]
    assert offenders == []


def test_commands_that_do_not_run_ray_do_not_import_it():
    """Every command loads the CLI plugins (`actors.cli`, `benchmarks.cli`, `deployments.cli`); only
    the ones that start Ray may import it."""
    code = ("import sys, contextlib, io\n"
            "from specdec.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['models', 'list']) == 0\n"
            "    try:\n"
            "        main(['--help'])\n"
            "    except SystemExit:\n"
            "        pass\n"
            "import actors\n"
            "assert 'ray' not in sys.modules, 'ray imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_actors_and_builder_do_not_import_each_other():
    """The coordinator gets the shard group's lifecycle from `actors/groups.py`; `builder.py` starts
    the coordinator. Neither imports the other at module level."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "actors"
    assert "actors.builder" not in (root / "coordinator.py").read_text()
    assert "from actors.coordinator" not in (root / "groups.py").read_text()


HEAVY_MODULES = ("torch", "transformers", "ray", "numpy", "safetensors.torch")


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "--help"], ["bench", "--help"],
                                  ["models", "list"], ["models", "rm", "smollm2-135m-instruct"],
                                  ["models", "rm", "no-such"]])
def test_commands_that_load_no_model_import_no_heavy_library(argv, tmp_path):
    """`specdec --help`, `models list` and `models rm` answer in well under a second because they do
    not import torch, transformers or Ray (each costs seconds); checked on the modules, not the time."""
    (tmp_path / "models" / "smollm2-135m-instruct").mkdir(parents=True)
    code = ("import sys, contextlib, io\n"
            "from specdec.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "    try:\n"
            f"        main({argv!r})\n"
            "    except SystemExit:\n"
            "        pass\n"
            f"print(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))\n")
    env = {**os.environ, "SPECDEC_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"specdec {' '.join(argv)} imported {proc.stdout.strip()}"
