"""Every repository path a docstring, comment, string, README or docs page names exists in the checkout: a
newcomer who follows `jobs/config.py` finds the file (the rooms are top-level folders, not under `fleetgen/`:
docs/development.md says why). A name is taken as a repository path when its first part is one of the
checkout's top-level folders (or `fleetgen`, or `notes`, which the product may not cite: it lives outside);
placeholders (`<w>`, `{shard}`, `*`) and paths after a URL scheme are not paths of the checkout."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = re.compile(
    r"(?<![\w./<>{}*$~-])((?:[A-Za-z_][\w.-]*/)+[\w.-]+\.(?:py|md|toml|yaml|yml|json|txt|sh|cfg|ini|parquet|tar))\b"
)
READ = ("fleetgen", "jobs", "workers", "offload", "cluster", "bench", "docs")  # the product, its tools, its docs
FILES = ("README.md", "mkdocs.yml", "Makefile", "pyproject.toml", ".ci/run")


def named_paths(text: str) -> list[tuple[int, str]]:
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in PATH.finditer(text)]


def missing() -> list[str]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    tops = {f.split("/")[0] for f in files if "/" in f} | {"fleetgen", "notes"}
    out = []
    for f in files:
        if f.split("/")[0] not in READ and f not in FILES:
            continue
        base = ROOT / "docs" if f == "mkdocs.yml" else (ROOT / f).parent  # mkdocs names pages under docs/
        for line, path in named_paths((ROOT / f).read_text(errors="replace")):
            if path.split("/")[0] in tops and not (ROOT / path).exists() and not (base / path).exists():
                out.append(f"{f}:{line}: {path}")
    return out


def test_every_path_named_exists():
    assert missing() == []


def test_the_check_finds_a_path_that_is_not_there():
    """The check itself: the spellings the issue found (an import path as a file, a note outside the
    checkout) are caught; an output's keys and placeholders are not paths of the checkout."""
    text = "see fleetgen/jobs/config.py and notes/diffusers-group-offload.md; OUT/workers/<w>.json, jobs/config.py"
    assert [p for _, p in named_paths(text)] == [
        "fleetgen/jobs/config.py",
        "notes/diffusers-group-offload.md",
        "jobs/config.py",
    ]
    assert not (ROOT / "fleetgen/jobs/config.py").exists() and (ROOT / "jobs/config.py").exists()
