"""What a sweep run depends on, hashed, so that a rerun into an existing output folder never reuses a run made from
other inputs (issue 31, part 3).

A run's fingerprint covers four parts:
- `arguments`: its command-line arguments (config files named by their path inside the repository, so a moved or
  second checkout recognises its runs);
- `configs`: the text of every config file it reads: the base config, configs stacked after it (`--config=...` in
  the arguments) and config files those name in their values;
- `checkpoints`: the digest of every checkpoint it loads: any `.ckpt`/`.pt`/`.pth`/`.safetensors` path among the
  argument values and the config files' values (`missing` while the file does not exist);
- `source`: a digest of the package's source (every .py/.cpp/.h file of glm_lightning, callbacks, datamodules);
- `environment`: torch's and Lightning's versions and the CPU key (`glm_lightning.machine.cpu_key`: model name and
  torch's CPU capability), since a seed fixes a result only on one CPU kind with one library build (issue 47);
- `inputs` (when a study names them, `inputs:` in its file): the digest of files the study's settings were derived
  from outside any config, e.g. the measured step times its equal-time twins' step counts come from.

`describe_changes` names the parts that differ between two runs, for the sweep's refusal message.
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("glm_lightning", "callbacks", "datamodules")
SOURCE_SUFFIXES = (".py", ".cpp", ".h")
CONFIG_SUFFIXES = (".yaml", ".yml", ".json", ".jsonnet")
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth", ".safetensors")
MISSING = "missing"
PARTS = ("arguments", "configs", "checkpoints", "source", "environment")


def portable_path(path: Path) -> str:
    """`path` relative to the repository root when it lies inside it, else its file name."""
    try:
        return Path(path).resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return Path(path).name


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@functools.lru_cache(maxsize=256)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    del size, mtime_ns  # part of the cache key only: a rewritten file is hashed again
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (cached per path, size and modification time: checkpoints are large)."""
    st = path.stat()
    return _file_digest(str(path.resolve()), st.st_size, st.st_mtime_ns)


def source_files(root: Path = REPO_ROOT) -> list[Path]:
    """The package's source files, in a fixed order."""
    files = []
    for top in SOURCE_DIRS:
        files += [p for p in (root / top).rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES
                  and "__pycache__" not in p.parts]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


@functools.lru_cache(maxsize=4)
def source_digest(root: Path = REPO_ROOT) -> str:
    """One digest of every source file's path and bytes (computed once per process)."""
    h = hashlib.sha256()
    for path in source_files(root):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def resolve_file(value: str, near: Sequence[Path]) -> Path | None:
    """The existing file `value` names (relative paths: the working directory first, as the run resolves them,
    then the directories in `near`), else None."""
    p = Path(value)
    if p.is_absolute():
        return p if p.is_file() else None
    for d in (Path.cwd(), *near):
        if (d / p).is_file():
            return d / p
    return None


def _arg_values(args: Sequence[str]) -> list[str]:
    """The values of `--key=value` / `--key value` arguments (structured JSON values flattened to their strings)."""
    out = []
    for i, arg in enumerate(args):
        if arg.startswith("--") and "=" in arg:
            value = arg.split("=", 1)[1]
        elif not arg.startswith("--") and i > 0 and args[i - 1].startswith("--") and "=" not in args[i - 1]:
            value = arg
        else:
            continue
        try:
            parsed = json.loads(value) if value[:1] in "[{" else value
        except json.JSONDecodeError:
            parsed = value
        out += list(_strings(parsed))
    return out


def referenced_files(args: Sequence[str]) -> tuple[dict[str, Path], dict[str, Path | None]]:
    """(config files by portable name, checkpoints by the path as written -> file or None when missing) that the
    arguments name, directly or through the values of the config files they name (recursively)."""
    configs: dict[str, Path] = {}
    checkpoints: dict[str, Path | None] = {}
    todo = [(v, ()) for v in _arg_values(args)]
    while todo:
        value, near = todo.pop(0)
        suffix = Path(value).suffix.lower()
        if suffix in CHECKPOINT_SUFFIXES:
            checkpoints.setdefault(value, resolve_file(value, near))
            continue
        if suffix not in CONFIG_SUFFIXES:
            continue
        path = resolve_file(value, near)
        if path is None or portable_path(path) in configs:
            continue
        configs[portable_path(path)] = path
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError, UnicodeDecodeError):
            continue
        todo += [(s, (path.parent,)) for s in _strings(data)]
    return configs, checkpoints


def portable_args(args: Sequence[str]) -> list[str]:
    """The arguments with config-file paths replaced by their portable names."""
    out = []
    for i, arg in enumerate(args):
        if i > 0 and args[i - 1] == "--config":
            out.append(portable_path(Path(arg)))
        elif arg.startswith("--config="):
            out.append("--config=" + portable_path(Path(arg.split("=", 1)[1])))
        else:
            out.append(arg)
    return out


def fingerprint_parts(args: Sequence[str]) -> dict[str, Any]:
    """The four parts (see the module docstring) of a run with these arguments."""
    configs, checkpoints = referenced_files(args)
    return {
        "arguments": _sha(json.dumps(portable_args(args)).encode())[:16],
        "configs": {name: file_digest(path)[:16] for name, path in sorted(configs.items())},
        "checkpoints": {name: file_digest(path)[:16] if path is not None else MISSING
                        for name, path in sorted(checkpoints.items())},
        "source": source_digest(),
    }


@functools.lru_cache(maxsize=1)
def environment() -> dict[str, str]:
    """torch's and Lightning's versions and the CPU key of this machine."""
    import lightning
    import torch

    from glm_lightning.machine import cpu_key

    return {"torch": str(torch.__version__), "lightning": str(lightning.__version__), "cpu": cpu_key()}


def input_digests(paths: Sequence[str]) -> dict[str, str]:
    """Digest of each study input (repository-relative path; `missing` when absent)."""
    out = {}
    for name in paths:
        path = REPO_ROOT / name
        out[name] = file_digest(path)[:16] if path.is_file() else MISSING
    return out


def combine(parts: dict[str, Any]) -> str:
    """The run's fingerprint: one digest of its parts."""
    return _sha(json.dumps(parts, sort_keys=True).encode())[:16]


def describe_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between a finished run's parts (`old`) and the planned run's (`new`), in words."""
    out = []
    if old.get("arguments") != new.get("arguments"):
        out.append("the arguments")
    for kind, label in (("configs", "config"), ("checkpoints", "checkpoint")):
        a, b = old.get(kind) or {}, new.get(kind) or {}
        for name in sorted(set(a) | set(b)):
            if name not in a:
                out.append(f"{label} {name} (new)")
            elif name not in b:
                out.append(f"{label} {name} (no longer read)")
            elif a[name] != b[name]:
                out.append(f"{label} {name} ({a[name][:8]} -> {b[name][:8]})")
    if old.get("source") != new.get("source"):
        out.append(f"the package source ({str(old.get('source'))[:8]} -> {str(new.get('source'))[:8]})")
    a_env, b_env = old.get("environment") or {}, new.get("environment") or {}
    for key in sorted(set(a_env) | set(b_env)):
        if a_env.get(key) != b_env.get(key):
            out.append(f"{key} ({a_env.get(key, 'unrecorded')} -> {b_env.get(key, 'unrecorded')})")
    a_in, b_in = old.get("inputs") or {}, new.get("inputs") or {}
    for name in sorted(set(a_in) | set(b_in)):
        if a_in.get(name) != b_in.get(name):
            out.append(f"study input {name} ({str(a_in.get(name, 'new'))[:8]} -> {str(b_in.get(name, 'gone'))[:8]})")
    return out


def git_revision() -> str:
    """The checked-out commit (short hash), marked when tracked files have uncommitted changes; "unknown" outside
    a git checkout."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (rev or "unknown") + (" (with uncommitted changes)" if dirty else "")
