"""What the verifier's isolation suites read from outside the sandbox after a case: files of the sandbox uid,
SysV IPC objects and processes left behind. One home for both suites (test_verifier_isolation, test_verifier_kernel)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from glm_lightning.verifier.uids import is_pool_uid

SANDBOX_UID = 65534  # nobody: the uid of every job when the uid pool is off (and of the fallback)


def is_sandbox_uid(uid: int) -> bool:
    """A uid candidates run as: nobody, or any uid of the verifier's leased blocks (one uid per job)."""
    return uid == SANDBOX_UID or is_pool_uid(uid)


def sandbox_files(places: Iterable[str], max_depth: int) -> set[str]:
    """Entries owned by the sandbox uid below `places`, down to `max_depth` levels of subdirectories. Scratch
    directories of verifier pools (`glm-verifier-*`) are skipped: other processes on this machine may be running
    their own verifiers."""
    found = set()
    for top in places:
        stack = [(top, 0)]
        while stack:
            path, depth = stack.pop()
            try:
                with os.scandir(path) as entries:
                    for entry in entries:
                        try:
                            info = entry.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        if is_sandbox_uid(info.st_uid):
                            found.add(entry.path)
                        elif entry.is_dir(follow_symlinks=False) and depth < max_depth and \
                                not entry.name.startswith("glm-verifier-"):
                            stack.append((entry.path, depth + 1))
            except OSError:
                pass
    return found


def sysv_objects() -> set[str]:
    """Every SysV shared memory segment, semaphore set and message queue on the host (kind:key)."""
    found = set()
    for kind in ("shm", "sem", "msg"):
        try:
            lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
        except OSError:
            continue
        found |= {f"{kind}:{line.split()[1]}" for line in lines if line.split()}
    return found


def stray_processes() -> list[str]:
    """Descendants of this process that are not the verifier's launcher/zygote pairs, plus zombies."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            table[int(entry)] = (int(stat[1]), stat[0], cmd)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    stray, stack = [], [os.getpid()]
    while stack:
        for pid in children.get(stack.pop(), []):
            _, state, cmd = table[pid]
            if state == "Z" or not ("launcher.py" in cmd or "zygote.py" in cmd):
                stray.append(f"{pid} {state} {cmd[:80]}")
            stack.append(pid)
    return stray
