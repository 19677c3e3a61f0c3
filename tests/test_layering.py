"""Imports go one way: deployments -> actors -> specdec. The core never imports Ray."""

import subprocess
import sys


def test_import_specdec_does_not_import_ray():
    code = "import sys, specdec, specdec.cli, specdec.engine; assert 'ray' not in sys.modules, 'ray imported'"
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
