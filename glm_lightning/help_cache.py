"""`fit --help` (and `validate`/`test`) from a cache: the stage CLI's help lists every Lightning and project option,
which takes the seconds of importing Lightning to build; the text only changes with the code, the libraries and the
width it is built at (fixed), so it is kept once per code and library versions (`~/.cache/glm_lightning/help/`, `XDG_CACHE_HOME`
respected; `GLM_HELP_CACHE=0` turns it off).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
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
    """What the help text depends on: the command line, the project's sources (names, sizes, mtimes), the library
    versions (the text is built at a fixed width, `WIDTH`)."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256("\0".join(argv).encode())
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            st = path.stat()
            digest.update(f"{path.relative_to(ROOT)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    for name in LIBRARIES:
        try:
            digest.update(f"{name}={version(name)}\n".encode())
        except PackageNotFoundError:
            digest.update(f"{name}=none\n".encode())
    return digest.hexdigest()[:32]


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
