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
