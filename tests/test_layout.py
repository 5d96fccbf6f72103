"""The README's "Layout" section matches the tree: every path it names exists, and every top-level folder and every
module or subpackage of `glm_lightning/` is named there (a new file or a move must update the map)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def layout_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Layout\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def named_paths(section: str) -> set[str]:
    """Paths in the first column; `a/b.py`, `c.py` in one cell means a/b.py and a/c.py."""
    paths: set[str] = set()
    for row in section.splitlines():
        if not row.startswith("| `"):
            continue
        parent = ""
        for name in re.findall(r"`([^`]+)`", row.split("|")[1]):
            name = name.rstrip("/")
            if "/" in name:
                parent = name.rsplit("/", 1)[0]
            elif parent:
                name = f"{parent}/{name}"
            paths.add(name)
    return paths


def tracked_top_level() -> set[str]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return {f.split("/")[0] for f in files if "/" in f} | {f for f in files if "/" not in f and not f.startswith(".")}


def test_every_named_path_exists():
    missing = sorted(p for p in named_paths(layout_section()) if not (ROOT / p).exists())
    assert not missing, missing


def test_every_folder_and_package_module_is_named():
    named = named_paths(layout_section())
    wanted = {d for d in tracked_top_level() if (ROOT / d).is_dir() and not d.startswith(".")}
    wanted |= {f"glm_lightning/{p.name}" for p in (ROOT / "glm_lightning").iterdir()
               if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py")}
    assert not sorted(wanted - named), sorted(wanted - named)
