"""A distinct kernel uid per job: blocks of host uids leased per sandbox server.

Why (issue 46, category 2): the kernel keeps per-user counts (processes, queued signals, in-flight SCM_RIGHTS
descriptors, pipe buffer pages, epoll watches, inotify instances, locked memory...) in `struct user_struct` /
ucounts, keyed by the global uid. When every candidate runs as `nobody`, one candidate can set such a count and
another can read it exactly: a value channel. Giving every job its own uid closes the whole family at once instead
of capping counter by counter. nsjail and bubblewrap map one uid per sandbox through a user namespace; here the
server runs as real root in its own mount/PID namespaces, so the child simply `setuid`s to a uid nobody else uses.

Allocation is host-wide and needs no daemon: block `i` (BLOCK_SIZE uids from UID_BASE + i * BLOCK_SIZE) belongs to
whoever holds an exclusive `flock` on LEASE_DIR/<i>. The parent takes the first free block and hands the lease
descriptor to the server's launcher, which keeps it open while it waits for the zygote; the kernel drops the lock
when the last holder exits, so a killed trainer or server frees its block by itself and a block is never handed
out while a process of a previous owner can still run. Two servers (of one pool, of two pools, of two processes on
the machine) never share a block; within a server the zygote cycles through its block, one uid per job.

The range 0x6F000000-0x6FFFFFFF lies at the top of systemd's container uid range (524288-1879048191), away from
system, regular and DynamicUser ids. Without root there is no uid pool (the candidate runs as the caller's uid in a
user namespace; docs/verifier.md lists this under the gaps).
"""

from __future__ import annotations

import fcntl
import os

UID_BASE = 0x6F000000
BLOCK_SIZE = 256
BLOCKS = 0x1000000 // BLOCK_SIZE  # 65536 blocks: up to 0x6FFFFFFF
UID_END = UID_BASE + BLOCKS * BLOCK_SIZE
LEASE_DIRS = ("/run/glm-verifier-uids", "/dev/shm/glm-verifier-uids")


def is_pool_uid(uid: int) -> bool:
    """True for every uid a job may run as (used by the clean-up of the fallback and by the tests)."""
    return UID_BASE <= uid < UID_END


class UidLease:
    """An exclusive lease on one uid block; `fd` is passed to the launcher, `close` gives up our copy."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.block: int | None = None
        directory = _lease_dir()
        for index in range(BLOCKS):
            fd = os.open(os.path.join(directory, str(index)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.fd, self.block = fd, index
            return
        raise RuntimeError("no free uid block for the verifier")

    @property
    def first_uid(self) -> int:
        assert self.block is not None
        return UID_BASE + self.block * BLOCK_SIZE

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def _lease_dir() -> str:
    """A root-only directory for the lease files (the first of LEASE_DIRS that can be made)."""
    for directory in LEASE_DIRS:
        try:
            os.makedirs(directory, 0o700, exist_ok=True)
            info = os.lstat(directory)
            if info.st_uid == os.geteuid() and not info.st_mode & 0o077:
                return directory
        except OSError:
            continue
    raise RuntimeError("no directory for the verifier's uid leases")
