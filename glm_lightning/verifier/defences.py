"""Names of the issue-46 defences and the test-only switch that turns single ones off.

Why a switch: every hostile test of issue 46 must be able to fail, so each defence can be disabled on its own
(`GLM_VERIFIER_UNSAFE_DEFENCES_OFF=futex,uid_pool`) and a test then shows the attack succeeds without it. Any
name set here makes the Verifier report a weaker sandbox (it refuses unless opted in, like the other UNSAFE
switches). Never set in training.
"""

from __future__ import annotations

import os

ENV = "GLM_VERIFIER_UNSAFE_DEFENCES_OFF"
# name -> what it turns off (docs/verifier.md, "Shared kernel state", has the per-category table)
DEFENCES = {
    "futex": "futex only with FUTEX_PRIVATE_FLAG (no futex keyed on a shared inode)",
    "uid_pool": "a distinct kernel uid per job from a leased per-server block (no shared per-uid accounting)",
    "sendmsg": "sendmsg refused (no SCM_RIGHTS: no descriptor in flight, no socket outlives its job)",
    "sockets": "setsockopt refused and socketpair stream-only (socket buffers stay at wmem_default)",
    "proc_view": "synthetic /proc/meminfo, stat, ...; host-wide /proc files masked; sysinfo refused",
    "prctl": "prctl only for an allow-list of options (no PR_SET_DUMPABLE: pagemap stays unreadable)",
    "sync": "fsync/fdatasync are no-ops (no host disk cache flush)",
    "odirect": "open/openat/fcntl(F_SETFL) without O_DIRECT",
    "sigpending": "RLIMIT_SIGPENDING 0 (no queued real-time signals)",
    "fresh_tmpfs": "new tmpfs instances for every job (no inode counter, free space or held file shared with the "
                   "next job)",
    "resident_root": "private always-resident tmpfs copies of the interpreter, stdlib and system libraries "
                     "(no shared inode or page cache)",
}


def switched_off() -> list[str]:
    """The defences the test-only environment variable disables; unknown names raise ValueError."""
    raw = os.environ.get(ENV, "")
    names = sorted({name.strip() for name in raw.split(",") if name.strip()})
    unknown = [name for name in names if name not in DEFENCES]
    if unknown:
        raise ValueError(f"{ENV}: unknown defence(s) {unknown}; known: {sorted(DEFENCES)}")
    return names
