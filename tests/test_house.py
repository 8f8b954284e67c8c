"""The house rules (docs/architecture.md, "The rooms"): which room may import which, the
one-way order of workers/' sub-packages, one installed package listing every sub-package, and the
commands that only read an output loading no torch."""

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("jobs", "workers", "offload", "cluster")
# workers/ follows a row through the device; a layer imports only the layers before it.
# `spec.py` (the records a worker is given) sits between the rows and the fitted pipeline.
LAYERS = [
    {"families", "output"},
    {"rows"},
    {"spec"},
    {"pipeline"},
    {"records", "info", "best_of", "score_tables", "notice"},
    {"attempt"},  # an attempt at a shard and its commits
    {"worker"},
]


def _imports(path: Path, top_level_only: bool = False) -> list[str]:
    """The modules a file imports (`top_level_only`: at module level, not inside functions)."""
    return _imported_by(ast.parse(path.read_text()), top_level_only)


def _imported_by(tree: ast.Module, top_level_only: bool = False) -> list[str]:
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif top_level_only and isinstance(node, ast.If):  # `if TYPE_CHECKING:` imports nothing at run time
            continue
    return found


def _files(room: str) -> list[Path]:
    return sorted((ROOT / room).rglob("*.py"))


def _layer(path: Path) -> str:
    """workers/<sub>/x.py -> sub; workers/x.py -> x (its own module)."""
    parts = path.relative_to(ROOT / "workers").parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def test_workers_sub_packages_import_one_way():
    rank = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    wrong = []
    for path in _files("workers"):
        here = _layer(path)
        if here == "__init__":
            continue
        for module in _imports(path):
            if not module.startswith("fleetgen.workers."):
                continue
            there = module.split(".")[2]
            if here == "tiny" or there == "tiny":
                if here != there:
                    wrong.append(f"{path.relative_to(ROOT)} imports {module} (tiny/ stands alone)")
            elif there != here and rank[there] >= rank[here]:
                wrong.append(f"{path.relative_to(ROOT)} ({here}) imports {module} ({there})")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "room, never",
    [
        ("offload", ("ray", "fsspec", "fleetgen.jobs", "fleetgen.workers", "fleetgen.cluster")),
        ("workers", ("ray", "fleetgen.jobs", "fleetgen.cluster")),
        ("cluster", ("fleetgen.jobs",)),
        ("jobs", ("ray",)),
    ],
)
def test_rooms_import_only_what_the_design_allows(room, never):
    wrong = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in _files(room)
        for module in _imports(path)
        if any(module == n or module.startswith(n + ".") for n in never)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_shared_leaf_imports_no_room_and_the_api_none_at_import():
    above = ("__init__.py", "__main__.py", "api.py", "cli.py", "ray_data.py")  # the API over the rooms, the CLI over it
    leaf = [p for p in (ROOT / "fleetgen").glob("*.py") if p.name not in above]
    wrong = [f"{p.name} imports {m}" for p in leaf for m in _imports(p) if m.split(".")[:2][-1] in ROOMS or m == "ray"]
    for name in ("api.py", "cli.py", "ray_data.py"):
        wrong += [f"{name} imports {m} at import" for m in _imports(ROOT / "fleetgen" / name, True) if "jobs" in m]
    assert not wrong, "\n".join(wrong)


def test_the_command_line_calls_the_api_and_the_rooms_never_call_up():
    """One way down: `fleetgen ...` (fleetgen/cli.py) does each command through the Python API
    (fleetgen/api.py), which calls the rooms; no room imports the API or the command line (nor a
    bare `import fleetgen`, whose names are the API)."""
    import fleetgen

    leaf = {"__version__", *(n for n in fleetgen.__all__ if n[0].isupper())}  # the version, the exception tree
    wrong = []
    for path in [p for room in ROOMS for p in _files(room)]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(
                a.name in ("fleetgen", "fleetgen.api", "fleetgen.cli") for a in node.names
            ):
                wrong.append(f"{path.relative_to(ROOT)}: import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.ImportFrom) and node.module in ("fleetgen.api", "fleetgen.cli"):
                wrong.append(f"{path.relative_to(ROOT)}: from {node.module} import ...")
            elif isinstance(node, ast.ImportFrom) and node.module == "fleetgen":
                wrong += [
                    f"{path.relative_to(ROOT)}: from fleetgen import {a.name}" for a in node.names if a.name not in leaf
                ]
    tree = ast.parse((ROOT / "fleetgen" / "cli.py").read_text())
    table = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "COMMANDS")
    handlers = {v.id for v in table.value.values}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in handlers:
            wrong += [f"cli.py {node.name} imports {m}" for m in _imported_by(ast.Module(node.body, [])) if "." in m]
            calls = [
                n for n in ast.walk(node) if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "fleetgen"
            ]
            if not calls:
                wrong.append(f"cli.py {node.name} calls no `fleetgen.<api>` function")
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_a_room_by_its_old_top_level_name():
    """Installed, the rooms are `fleetgen.<room>`: a bare `import jobs` would find another project's
    package (or none)."""
    wrong = []
    folders = [d for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith(".")]  # not .venv's thousands
    for path in [p for folder in folders for p in folder.rglob("*.py")]:
        if "site-packages" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        found = _imported_by(tree) + [m for code in _code_strings(tree) for m in _imported_by(code)]
        wrong += [f"{path.relative_to(ROOT)}: {m}" for m in found if m.split(".")[0] in ROOMS]
    assert not wrong, "\n".join(wrong)


def _code_strings(tree: ast.Module) -> list[ast.Module]:
    """The Python code a file holds in strings that import something (`python -c` scripts), parsed."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "import " in node.value:
            try:
                found.append(ast.parse(node.value))
            except SyntaxError:
                continue
    return found


def test_every_package_is_in_the_wheel():
    """pyproject lists the packages one by one (the rooms are mapped into `fleetgen`): a new
    sub-package left out of the list would be missing from an installed fleetgen. Folders of package
    data whose paths are valid package names are listed too (setuptools warns on every install about
    each one left out); nothing else is."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = [
        folder
        for room in ROOMS
        for folder in [ROOT / room, *(ROOT / room).rglob("*")]
        if folder.is_dir() and folder.name != "__pycache__"
    ]

    def name(folder: Path) -> str:
        return ".".join(("fleetgen", *folder.relative_to(ROOT).parts))

    code = {name(f) for f in folders if (f / "__init__.py").exists()}
    data = {
        name(f)
        for f in folders
        if not (f / "__init__.py").exists()
        and all(part.isidentifier() for part in f.relative_to(ROOT).parts)
        and any(x.is_file() for x in f.iterdir())
    }
    assert listed == {"fleetgen"} | code | data


def test_the_commands_that_read_an_output_import_no_torch(tmp_path, tiny_model):
    """`fleetgen status`, `verify` and `report` on a finished output, in a process of their own:
    neither torch nor Ray nor diffusers is imported (they start in a second, on any machine)."""
    from fleetgen.jobs.models import resolve_defaults
    from fleetgen.jobs.sharding import read_footer, resolve_columns
    from fleetgen.jobs.state import claim_output, fingerprint
    from fleetgen.workers.output.storage import Output
    from tests.conftest import make_job, run_one_shard, write_prompts

    prompts = write_prompts(tmp_path / "p.parquet", ["a red square", "a blue circle"])
    out = tmp_path / "out"
    files = [read_footer(str(prompts))]
    config = make_job(prompts, tiny_model, out)
    columns = resolve_columns(files, config.columns)
    config, _, _ = resolve_defaults(config, columns)
    claim_output(Output(str(out)), config, fingerprint(config, files, columns), 1)
    run_one_shard(tiny_model, out, prompts, config.generation)
    code = (
        "import sys; from fleetgen.cli import main\n"
        f"codes = [main([c, {str(out)!r}]) for c in ('status', 'verify', 'report')]\n"
        "heavy = [m for m in ('torch', 'diffusers', 'transformers', 'ray') if m in sys.modules]\n"
        "print(codes, heavy); sys.exit(0 if not heavy and codes[1] == 0 else 1)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env={**os.environ}, timeout=120
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (out / "report.html").exists()


TORCH_FREE = (  # modules whose docstrings say they load no torch: the driver, `status` and `verify` import them
    "fleetgen",
    "fleetgen.caches",
    "fleetgen.attention",
    "fleetgen.offload.weight_formats",
    "fleetgen.offload.cost",
    "fleetgen.offload.planner",
    "fleetgen.workers.families.table",
    "fleetgen.workers.families.detect",
    "fleetgen.workers.families.model_dir",
    "fleetgen.workers.spec",
    "fleetgen.jobs.config",
    "fleetgen.jobs.validate",
    "fleetgen.jobs.status",
    "fleetgen.jobs.verify",
    "fleetgen.cluster",  # the driver: the workers' modules load in the actors' processes
    "fleetgen.jobs.driver",
    "fleetgen.jobs.planning",  # `fleetgen plan` on a shipped architecture reads its stored profile
    "fleetgen.offload.profiles",
    "fleetgen.offload.devices",
)


def test_the_modules_that_say_they_load_no_torch_load_none():
    code = (
        "import importlib, sys\n"
        f"for name in {TORCH_FREE!r}:\n"
        "    importlib.import_module(name)\n"
        "    if 'torch' in sys.modules:\n"
        "        sys.exit(f'{name} loaded torch')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_plan_on_a_shipped_architecture_imports_no_torch_nor_diffusers():
    """`fleetgen plan --model NAME` reads the stored profile: the process stays small and answers in
    about a second (BENCHMARKS.md), where building the model on `meta` imported diffusers,
    transformers and peft (~9 s). A pipeline directory still builds on `meta`."""
    code = (
        "import sys\n"
        "from fleetgen.cli import main\n"
        "code = main(['plan', '--model', 'flux.2-klein-4b', '--gpu', 'RTX-4090', '--host-memory', '64GiB'])\n"
        "heavy = [m for m in ('torch', 'diffusers', 'transformers', 'peft') if m in sys.modules]\n"
        "sys.exit(f'exit {code}, loaded {heavy}' if code or heavy else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.stdout[-1000:], done.stderr[-2000:])
    assert "RTX-4090" in done.stdout and "flux.2-klein-4b" in done.stdout
