"""A private view of /proc for the sandbox: no file in it shows a host-wide counter.

Why (issue 46, category 5): the kernel's /proc is per PID namespace only for the process directories; /proc/meminfo,
stat, vmstat, loadavg, pressure/, sys/fs/file-nr & co. are host-wide. One candidate's tmpfs writes move `Shmem`
(and sysinfo's sharedram), which another candidate reads: a noise-free value channel. The rule here is default-deny,
not a list of known leaks: every top-level /proc entry that is not a process directory or in KEEP is replaced, either
by a synthetic file whose content depends only on the server's configuration (meminfo from `memory_mb`, stat from
the CPU count, cpuinfo without the clock speed) or by an empty file / an empty read-only tmpfs. This is what LXCFS
does for containers (bind-mounted synthetic meminfo, stat, uptime, loadavg...) and what runc's masked paths do
(a read-only empty file or tmpfs over each entry). gVisor answers /proc from its own sentry (meminfo from the
sandbox's usage). Run by the launcher (our trusted code) after the fresh /proc is mounted, before seccomp.
"""

from __future__ import annotations

import os
from typing import Callable

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
# Entries that show only our namespaces or static facts; process directories are kept as well.
KEEP = frozenset({"self", "thread-self", "mounts", "net", "filesystems", "version", "sys"})
# Below /proc/sys: host-wide counters (file-nr, inode-nr, dentry-state, aio-nr; entropy), masked too.
SYS_MASKED = ("fs", "kernel/random")
MEMINFO_FIELDS = ("Buffers", "Cached", "SwapCached", "Active", "Inactive", "Active(anon)", "Inactive(anon)",
                  "Active(file)", "Inactive(file)", "Unevictable", "Mlocked", "SwapTotal", "SwapFree", "Dirty",
                  "Writeback", "AnonPages", "Mapped", "Shmem", "KReclaimable", "Slab", "SReclaimable", "SUnreclaim",
                  "KernelStack", "PageTables", "CommitLimit", "Committed_AS", "VmallocUsed", "HugePages_Total",
                  "HugePages_Free")


def synthetic_files(memory_mb: int, cpus: int, cpuinfo: str) -> dict[str, str]:
    """Contents that depend only on the configuration (never on what runs on the host)."""
    total = memory_mb * 1024
    meminfo = f"MemTotal: {total:>14} kB\nMemFree: {total:>15} kB\nMemAvailable: {total:>10} kB\n" + \
        "".join(f"{name + ':':<15}{0:>9} kB\n" for name in MEMINFO_FIELDS)
    zeros = " 0" * 10
    stat = f"cpu {zeros}\n" + "".join(f"cpu{i}{zeros}\n" for i in range(cpus)) + \
        "intr 0\nctxt 0\nbtime 0\nprocesses 0\nprocs_running 1\nprocs_blocked 0\nsoftirq 0\n"
    static_cpuinfo = "".join(line + "\n" for line in cpuinfo.splitlines() if not line.startswith("cpu MHz"))
    return {"meminfo": meminfo, "stat": stat, "cpuinfo": static_cpuinfo, "loadavg": "0.00 0.00 0.00 1/1 1\n",
            "uptime": "0.00 0.00\n"}


def install(mount: Callable[..., None], store: str, memory_mb: int, cpus: int, cpuinfo: str) -> dict[str, int]:
    """Mask /proc (already mounted fresh) with the files written under `store` (a directory in the private root).

    Returns counts of what was replaced; raises OSError if any mask fails (the caller reports it)."""
    os.makedirs(store, 0o755, exist_ok=True)
    files = synthetic_files(memory_mb, cpus, cpuinfo)
    empty = os.path.join(store, "empty")
    with open(empty, "w"):
        pass
    done = {"synthetic": 0, "empty_files": 0, "empty_dirs": 0}
    for name in sorted(os.listdir("/proc")):
        if name.isdigit() or name in KEEP:
            continue
        target = "/proc/" + name
        if name in files:
            source = os.path.join(store, name)
            with open(source, "w") as fh:
                fh.write(files[name])
            _bind_readonly(mount, source, target)
            done["synthetic"] += 1
        elif os.path.isdir(target) and not os.path.islink(target):
            _empty_dir(mount, target)
            done["empty_dirs"] += 1
        elif not os.path.islink(target):
            _bind_readonly(mount, empty, target)
            done["empty_files"] += 1
    for sub in SYS_MASKED:
        if os.path.isdir("/proc/sys/" + sub):
            _empty_dir(mount, "/proc/sys/" + sub)
            done["empty_dirs"] += 1
    return done


def _bind_readonly(mount: Callable[..., None], source: str, target: str) -> None:
    mount(source, target, None, MS_BIND, None)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None)


def _empty_dir(mount: Callable[..., None], target: str) -> None:
    mount("tmpfs", target, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,nr_inodes=8,mode=0555")
