"""A private, always-resident copy of every file a candidate can read, made once per pool on tmpfs.

Why (issue 46, categories 1, 6, 7): bind-mounting the host's interpreter, standard library and system libraries
into the private root shares their inodes and their page cache with the host and with every other server. Keyed on
the inode: futexes, locks, inotify; through the page cache: residency, which a candidate reads without mincore (a
read fault maps the already-cached neighbours of a page, "fault-around", and the process's own smaps, statm and
minor-fault count show how many; or simply by timing a read). Syscall rules close single calls; they cannot close
the page cache. A copy on tmpfs is a different inode that no process outside this pool can open, and its pages are
always resident (tmpfs without swap), so residency carries no information and the host's page cache is not
reachable at all. bubblewrap and nsjail bind host paths (the sharing stays); gVisor serves files through its own
gofer and page cache, and Firecracker gives the guest its own block device and page cache: the same idea.

The copy mirrors absolute paths (`<dest>/usr/lib/...`, `<dest>/root/.pyenv/...`); launcher.py bind-mounts its
top-level directories read-only into the private root. What is copied: the interpreter, libpython, the standard
library without the parts no candidate imports (tests, site-packages, IDLE, turtledemo, ensurepip, build config; optimised
.pyc variants), the shared libraries the interpreter and its extension modules link against (from `ldd`), the
dynamic loader, /etc/ld.so.cache and /usr/share/zoneinfo. ~100 MB here, ~0.3 s once per Verifier.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator

SKIP_DIRS = frozenset({"test", "site-packages", "idlelib", "turtledemo", "ensurepip"})
SKIP_SUFFIXES = (".opt-1.pyc", ".opt-2.pyc")
EXTRA_FILES = ("/etc/ld.so.cache",)
EXTRA_TREES = ("/usr/share/zoneinfo",)
LDD = ("/usr/bin/ldd", "/bin/ldd")


def _stdlib_files(lib: str) -> Iterator[str]:
    """libpython and the standard library below the interpreter's lib directory, minus SKIP_DIRS."""
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for name in os.listdir(lib):
        if name.startswith("libpython"):
            yield os.path.join(lib, name)
    top = os.path.join(lib, version)
    for root, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith("config-")]
        for name in files:
            if not name.endswith(SKIP_SUFFIXES):
                yield os.path.join(root, name)


def _shared_libraries(objects: list[str]) -> set[str]:
    """Every library `ldd` resolves for `objects`, plus the loader (paths as ldd prints them)."""
    ldd = next((p for p in LDD if os.path.exists(p)), None)
    if ldd is None:
        raise OSError("ldd not found: cannot tell which system libraries the interpreter needs")
    out = subprocess.run([ldd, *objects], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"}).stdout
    found = set(re.findall(r"=> (/\S+)", out)) | set(re.findall(r"^\s+(/\S+) \(0x", out, re.M))
    for path in list(found):  # glibc dlopens libgcc_s for unwinding (thread cancellation, backtraces)
        extra = os.path.join(os.path.dirname(path), "libgcc_s.so.1")
        if os.path.exists(extra):
            found.add(extra)
    return found


def _copy_file(path: str, dest: str) -> None:
    """Copy `path` (following links) to dest + its real path; keep `path`'s own name as a relative link to it."""
    real = os.path.realpath(path)
    target = dest + real
    if not os.path.exists(target):
        os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
        shutil.copy2(real, target)  # keeps the mtime: the .pyc files stay valid (no recompiling on import)
        os.chmod(target, 0o755 if os.stat(real).st_mode & 0o111 else 0o644)
    alias = dest + os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    if alias != target and not os.path.lexists(alias):
        os.makedirs(os.path.dirname(alias), 0o755, exist_ok=True)
        os.symlink(os.path.relpath(target, os.path.dirname(alias)), alias)


def build(dest: str) -> dict[str, int]:
    """Fill `dest` (an empty directory on tmpfs) with the copy; returns {"files": n, "bytes": size}."""
    old_umask = os.umask(0o022)
    try:
        python = os.path.realpath(sys.executable)
        lib = os.path.realpath(os.path.join(sys.base_prefix, "lib"))
        files = [python, *_stdlib_files(lib)]
        dynload = [f for f in files if f.endswith(".so") or ".so." in os.path.basename(f)]
        files += sorted(_shared_libraries([python, *dynload]))
        files += [p for p in EXTRA_FILES if os.path.exists(p)]
        for path in files:
            _copy_file(path, dest)
        for tree in EXTRA_TREES:
            if os.path.isdir(tree):
                real = os.path.realpath(tree)
                shutil.copytree(real, dest + real, symlinks=True, dirs_exist_ok=True)
        size = count = 0
        for root, _dirs, names in os.walk(dest):
            for name in names:
                info = os.lstat(os.path.join(root, name))
                size, count = size + info.st_size, count + 1
        return {"files": count, "bytes": size}
    finally:
        os.umask(old_umask)
