"""Fresh tmpfs instances for every job: the launcher's waiting process replaces the server's private tmpfs mounts
between jobs, at the zygote's request.

Why (issue 46): a tmpfs numbers its inodes from a counter of its own superblock, so with one /tmp per server the
next job reads (from the st_ino of its working directory or of any file it creates) how many files the previous job
created: a value channel between successive candidates of a server, however well the directory is emptied. Free
space, inode counts and whatever a leaked kernel object still holds are per superblock too. A new tmpfs per job
shares none of it; the old one is detached (`umount2(MNT_DETACH)`) and freed with its last reference.

Mounting needs CAP_SYS_ADMIN and the `mount` syscall, which the seccomp filter refuses to the zygote and to every
candidate. The launcher's waiting parent is the one process of the server outside that filter (it forked the zygote
before the filter was loaded) and root in the server's mount namespace (pivot_root moved its root too), so the
zygote asks it through a pipe: first one JSON line with the paths, then one byte "r" per job ("the same again");
one byte back ("1": done, "0": failed: the zygote then retires and the parent starts a fresh server). Only paths of
the launcher's own table are accepted.
"""

from __future__ import annotations

import json
import os
import select
import signal
from typing import Any, Callable

MS_NOSUID, MS_NODEV, MS_NOEXEC, MNT_DETACH = 2, 4, 8, 2


def remount(mount: Callable[..., None], umount: Callable[[str], None], paths: list[str],
            table: tuple[tuple[str, str, int], ...], work_dir: str) -> bool:
    """Detach the tmpfs at each of `paths` (deepest first) and mount a new one (shallowest first)."""
    specs = {path: (size, inodes) for path, size, inodes in table}
    wanted = sorted({p for p in paths if p in specs}, key=len)
    if len(wanted) != len(set(paths)):
        return False
    try:
        for path in reversed(wanted):
            umount(path)
        for path in wanted:
            size, inodes = specs[path]
            mode = 0o711 if path == work_dir else 0o1777
            if path == work_dir:  # its mount point lives in the new /tmp
                try:
                    os.mkdir(path, 0o711)
                except FileExistsError:
                    pass
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                  f"size={size},nr_inodes={inodes},mode={mode:o}")
    except OSError:
        return False
    return True


def serve(child: int, requests: int, replies: int, do_remount: Callable[[list[str]], bool]) -> int:
    """The launcher's wait loop: answer remount requests until the zygote exits; returns its wait status."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    watched, pending, paths = [wake_r, requests], b"", None
    while True:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            return status
        try:
            ready = select.select(watched, [], [])[0]
        except InterruptedError:
            continue
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        if requests in ready:
            chunk = os.read(requests, 4096)
            if not chunk:  # the zygote is exiting: keep waiting for it only
                watched.remove(requests)
                continue
            pending += chunk
            while pending:
                if pending[:1] == b"r":  # the same paths as last time
                    pending, ok = pending[1:], paths is not None and do_remount(paths)
                elif b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    paths = _paths(line)
                    ok = paths is not None and do_remount(paths)
                else:
                    break
                try:
                    os.write(replies, b"1" if ok else b"0")
                except OSError:
                    pass


def _paths(line: bytes) -> list[str] | None:
    try:
        paths: Any = json.loads(line)
    except ValueError:
        return None
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        return None
    return paths
