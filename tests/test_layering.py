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


# ------------------------------------------------------------------------- inside the core

#: The core's floors, bottom first: a module imports only from its own floor or those below
#: (lazy imports inside functions count: a lazy import that closes a circle is still a circle).
CORE_FLOORS = [
    ("ground", ("specdec", "specdec.config", "specdec.options", "specdec.constraint", "specdec.startup",
                "specdec.speedup")),
    ("models and kernels", ("specdec.models", "specdec.kernels")),
    ("decoding", ("specdec.decoding",)),
    ("engine", ("specdec.engine",)),
    ("command line", ("specdec.cli",)),
]


def core_imports(root=None) -> dict[str, set[str]]:
    """module -> the core modules it imports anywhere in its text (`from specdec.x import y` counts y
    when y is a module)."""
    import ast
    from pathlib import Path

    root = root or Path(__file__).resolve().parents[1]
    modules = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
               for p in (root / "specdec").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "specdec":
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.split(".")[0] == "specdec")
    return {name: {m for m in deps if m in modules and m != name} for name, deps in graph.items()}


def floor_of(module: str) -> int:
    best = None
    for level, (_, prefixes) in enumerate(CORE_FLOORS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + ".") and prefix != "specdec":
                if best is None or len(prefix) > best[1]:
                    best = (level, len(prefix))
    assert best is not None, f"{module} is on no floor of CORE_FLOORS"
    return best[0]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph` (strongly connected components of more than one module)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps if floor_of(b) > floor_of(a))


def test_the_core_has_no_import_circle_and_imports_only_downward():
    graph = core_imports()
    assert circles(graph) == []
    assert upward_imports(graph) == []


def test_an_upward_import_and_a_circle_are_caught():
    """The negative control, on the real graph plus what the old code had: config importing the
    grammar engine (which imports models, which import config), and models importing the engine."""
    graph = core_imports()
    graph["specdec.config"] = graph["specdec.config"] | {"specdec.decoding.structured_output"}
    graph["specdec.models.loading"] = graph["specdec.models.loading"] | {"specdec.engine.progress"}
    assert any("specdec.config" in c for c in circles(graph))
    assert "specdec.config -> specdec.decoding.structured_output" in upward_imports(graph)
    assert "specdec.models.loading -> specdec.engine.progress" in upward_imports(graph)
