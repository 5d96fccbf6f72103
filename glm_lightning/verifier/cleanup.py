"""Iterative removal of whatever a candidate left in a directory (used by the zygote and by the parent).

Why not shutil.rmtree: it recurses (thousands of nested directories overflow the stack or PATH_MAX), opens one fd
per level, follows the tree through paths and drags zlib/bz2/lzma into the zygote. Here every directory found below
the top is first *moved up* to the top level (rename with dir_fd, so path length never grows), then emptied; only
two fds are open at a time and the work is linear in the number of entries. Entries that are mount points (another
st_dev) are left alone. Stdlib only; imported by the zygote as a top-level module.
"""

from __future__ import annotations

import os
import stat

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _unlink(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _open_dir(name: str, dir_fd: int) -> int | None:
    """Open a sub-directory, making it searchable first (the candidate may have chmod-ed it to 0)."""
    try:
        os.chmod(name, 0o700, dir_fd=dir_fd)
    except OSError:
        pass
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None


def wipe(path: str, keep: frozenset[str] = frozenset(), max_entries: int = 1_000_000) -> bool:
    """Delete everything inside `path` (not `path` itself) except top-level names in `keep`.

    Returns True when the directory is empty (apart from `keep` and mount points) afterwards.
    """
    try:
        top = os.open(path, _DIR_FLAGS)
    except OSError:
        return not os.path.lexists(path)
    try:
        device = os.fstat(top).st_dev
        serial = 0
        for _ in range(max_entries):
            progress = False
            with os.scandir(top) as entries:
                batch = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries if e.name not in keep]
            if not batch and not serial and not progress:
                return True  # the common case: nothing was left behind
            for name, is_dir in batch:
                if not is_dir:
                    _unlink(name, top)
                    progress = True
                    continue
                try:
                    if os.stat(name, dir_fd=top, follow_symlinks=False).st_dev != device:
                        continue  # a mount point: not ours to empty
                    os.rmdir(name, dir_fd=top)
                    progress = True
                    continue
                except OSError:
                    pass
                sub = _open_dir(name, top)
                if sub is None:
                    continue
                try:
                    with os.scandir(sub) as inner:
                        children = [(e.name, e.is_dir(follow_symlinks=False)) for e in inner]
                    for child, child_is_dir in children:
                        if child_is_dir:
                            serial += 1
                            os.rename(child, f".wipe-{serial}-{os.getpid()}", src_dir_fd=sub, dst_dir_fd=top)
                        else:
                            _unlink(child, sub)
                        progress = True
                except OSError:
                    pass
                finally:
                    os.close(sub)
            if not progress:
                break
        with os.scandir(top) as entries:
            rest = [e.name for e in entries if e.name not in keep and not _is_mount(e, device)]
        return not rest
    finally:
        os.close(top)


def _is_mount(entry: os.DirEntry, device: int) -> bool:
    try:
        info = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_dev != device


def remove_tree(path: str) -> bool:
    """Delete `path` and everything below it; True when it is gone."""
    try:
        os.rmdir(path)  # the common case: the candidate left its directory empty
        return True
    except FileNotFoundError:
        return True
    except OSError:
        pass
    wipe(path)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        try:
            os.unlink(path)
        except OSError:
            return False
    return not os.path.lexists(path)
