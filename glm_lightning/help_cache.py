"""What the stage CLI's parser knows, kept so the command line can answer without the seconds of importing
Lightning: the text of `fit --help` (and `validate`/`test`), and the config schema (the keys of the trainer, of the
always-on sections and of every project class a config may name) with which `user_errors.check_config_files` finds a
misspelt key in a config file before any heavy import. Both only change with the code and the libraries, so they are
kept once per code and library versions (`~/.cache/glm_lightning/help/`, `XDG_CACHE_HOME` respected;
`GLM_HELP_CACHE=0` turns it off); `make venv` builds them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("glm_lightning", "callbacks", "datamodules")
WIDTH = 120
"""Columns the help text is built for (argparse reads COLUMNS): one text for every terminal, so the cache can be
built ahead of time (`make venv` does)."""
LIBRARIES = ("lightning", "jsonargparse", "torch", "torchmetrics", "docstring_parser")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "glm_lightning" / "help"


def cache_key(argv: Sequence[str]) -> str:
    """What the help text depends on: the command line, the project's sources and the library versions (the text is
    built at a fixed width, `WIDTH`)."""
    return hashlib.sha256(("\0".join(argv) + "\0" + code_digest()).encode()).hexdigest()[:32]


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """The project's sources (names, sizes, mtimes) and the library versions, read once per process (a fit asks
    for the schema path twice: before the imports and after them)."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            st = path.stat()
            digest.update(f"{path.relative_to(ROOT)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    for name in LIBRARIES:
        try:
            digest.update(f"{name}={version(name)}\n".encode())
        except PackageNotFoundError:
            digest.update(f"{name}=none\n".encode())
    return digest.hexdigest()


def is_help_only(argv: Sequence[str]) -> bool:
    """`fit --help` / `test -h`: a stage command asking for its help and nothing else."""
    return len(argv) == 2 and argv[0] in ("fit", "validate", "test") and argv[1] in ("-h", "--help")


def cached_help(argv: Sequence[str], build: Callable[[], None]) -> str:
    """The help text of `argv`: from the cache, else by running `build` (which prints it and exits) and keeping what
    it printed."""
    enabled = os.environ.get("GLM_HELP_CACHE", "1") != "0"
    path = cache_dir() / f"{cache_key(argv)}.txt" if enabled else None
    if path is not None and path.is_file():
        return path.read_text()
    out = io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)
    try:
        with contextlib.redirect_stdout(out):
            build()
    except SystemExit as done:
        if done.code not in (None, 0):
            raise
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    text = out.getvalue()
    if path is not None and text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return text


def schema_path() -> Path | None:
    if os.environ.get("GLM_HELP_CACHE", "1") == "0":
        return None
    return cache_dir() / f"schema-{cache_key(['schema'])}.json"


def build_schema() -> dict[str, object]:
    """The config keys the stage CLI accepts (imports Lightning and the project): the Trainer's arguments, each
    always-on section's, and each project class's init arguments (its own and its project base classes')."""
    import inspect

    import lightning.pytorch as pl

    import callbacks
    import datamodules
    import glm_lightning.modules as modules
    from callbacks.final_validation import FinalValidation
    from callbacks.last_checkpoint import LastCheckpoint
    from callbacks.preflight import Preflight

    def signatures(cls: type) -> list[inspect.Parameter]:
        out: list[inspect.Parameter] = []
        for klass in inspect.getmro(cls):
            if klass is cls or klass.__module__.split(".")[0] in ("glm_lightning", "callbacks", "datamodules"):
                try:
                    out += [p for n, p in inspect.signature(klass.__init__).parameters.items()
                            if n not in ("self", "args", "kwargs")]
                except (TypeError, ValueError):
                    pass
        return out

    def params(cls: type) -> list[str]:
        return sorted({p.name for p in signatures(cls)})

    def types(cls: type) -> dict[str, list[object]]:
        out: dict[str, list[object]] = {}
        for p in signatures(cls):  # the class's own annotation first (its MRO order)
            simple = simple_type(p.annotation)
            if p.name not in out and simple is not None:
                out[p.name] = list(simple)
        return out

    classes, class_types = {}, {}
    for module in (callbacks, datamodules, modules):
        for name, obj in vars(module).items():
            if inspect.isclass(obj):
                for key in {name, f"{obj.__module__}.{name}", f"{module.__name__}.{name}"}:
                    classes[key], class_types[key] = params(obj), types(obj)
    sections = {"last_checkpoint": LastCheckpoint, "preflight": Preflight, "final_validation": FinalValidation}
    return {"trainer": params(pl.Trainer), "classes": classes,
            "sections": {name: params(cls) for name, cls in sections.items()},
            "types": {"trainer": types(pl.Trainer), "classes": class_types,
                      "sections": {name: types(cls) for name, cls in sections.items()}}}


SIMPLE_TYPES = ("int", "float", "bool")


def simple_type(annotation: object) -> tuple[str, bool] | None:
    """`(name, nullable)` for an annotation that is int, float or bool, optionally with None (`int | None`,
    `Optional[int]`, `Union[int, NoneType]`); None for anything else (the parser checks those)."""
    import re

    text = re.sub(r"<class '(\w+)'>", r"\1", str(annotation)).replace("typing.", "")
    for pattern, nullable in ((r"^(\w+)$", False), (r"^(\w+) \| None$", True), (r"^None \| (\w+)$", True),
                              (r"^Optional\[(\w+)\]$", True), (r"^Union\[(\w+), NoneType\]$", True)):
        found = re.match(pattern, text)
        if found and found.group(1) in SIMPLE_TYPES:
            return found.group(1), nullable
    return None


def cached_schema() -> dict | None:
    """The cached schema, or None when it is not built for this code and these libraries."""
    path = schema_path()
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def keep_schema() -> None:
    """Build and keep the schema unless it is already kept (call where Lightning is imported anyway)."""
    path = schema_path()
    if path is None or path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(build_schema()))
    os.replace(tmp, path)
