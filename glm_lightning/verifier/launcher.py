"""First stage of every sandbox server: create the namespaces, mount private tmpfs, then exec the zygote.

Why a separate script: Python 3.11 has no `os.unshare`/`mount`, so this uses ctypes on libc. It is our own trusted
code and runs before any candidate exists; `execv` then replaces the whole interpreter, so neither ctypes nor anything
else from here is present in the zygote or in the children it forks.

    parent --Popen--> python -I -S -B launcher.py CONFIG          (this file; stays as the waiting parent)
                        unshare(user?) mount ipc net pid, each tried on its own (what works is reported)
                        fork --> PID 1 of the new PID namespace:
                                 / made private, fresh /proc, tmpfs (noexec,nosuid,nodev, size-capped) on /tmp,
                                 /var/tmp, /dev/shm and the work area, IPC object limits set to 0, memfd noexec,
                                 every other mount re-mounted read-only
                                 execv python -I -S -B zygote.py CONFIG+report

The waiting parent turns SIGTERM/SIGINT/SIGHUP into SIGKILL of the zygote (whose death ends the PID namespace with
every process in it) and exits with the zygote's status. Anything that fails is recorded and skipped: the zygote
then runs with less isolation and `Verifier.protections` says so (docs/verifier.md, "Fallback").
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ZYGOTE_SCRIPT = os.path.join(HERE, "zygote.py")

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET = 0x00020000, 0x08000000, 0x40000000
CLONE_NEWPID, CLONE_NEWUSER = 0x20000000, 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
MOUNT_FLAG_BITS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
WORK_DIR = "/tmp/.glm-work"  # the per-candidate working directories, on their own tmpfs
# (path, size, inodes) of the private tmpfs mounts; the inode cap bounds what cleanup may have to delete.
TMPFS = (("/tmp", "16m", 2048), ("/var/tmp", "16m", 2048), ("/dev/shm", "16m", 2048), (WORK_DIR, "32m", 4096))
IPC_LIMITS = (("kernel/shmmni", "0"), ("kernel/msgmni", "0"), ("kernel/sem", "0 0 0 0"),
              ("kernel/shm_rmid_forced", "1"), ("fs/mqueue/queues_max", "0"))

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def create_namespaces(as_root: bool) -> dict[str, bool]:
    """Try each namespace on its own; returns which ones this process now lives in (PID: its next child)."""
    done = {"user": False, "mount": False, "ipc": False, "net": False, "pid": False}
    if not as_root:
        uid, gid = os.getuid(), os.getgid()
        try:
            unshare(CLONE_NEWUSER)
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")  # same uid inside: caps are lost again at execv
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
            done["user"] = True
        except OSError:
            return done  # without root or a user namespace nothing else can be created
    for name, flag in (("mount", CLONE_NEWNS), ("ipc", CLONE_NEWIPC), ("net", CLONE_NEWNET), ("pid", CLONE_NEWPID)):
        try:
            unshare(flag)
            done[name] = True
        except OSError:
            pass
    return done


def _mount_points() -> list[tuple[str, set[str]]]:
    """(mount point, per-mount options) from /proc/self/mountinfo, parents before children."""
    out = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            fields = line.split()
            if len(fields) > 5 and "\\" not in fields[4]:
                out.append((fields[4], set(fields[5].split(","))))
    return out


def setup_mounts(spaces: dict[str, bool], report: dict[str, Any], host_scratch: str) -> None:
    """Private tmpfs for every writable place, a fresh /proc, everything else read-only (in our namespace only)."""
    mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    if spaces["pid"]:
        try:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
            report["private_proc"] = True
        except OSError as exc:
            report["errors"].append(str(exc))
    private = []
    needed = [HERE + "/", os.path.realpath(sys.executable)]
    if any(p.startswith("/tmp/") for p in needed):  # no private /tmp, so no work tmpfs: keep the host scratch
        needed.append(os.path.realpath(host_scratch) + "/")
    for path, size, inodes in TMPFS:
        if path == WORK_DIR and "/tmp" not in private:
            continue  # never create the work area's mount point on the host's /tmp
        if any(p.startswith(path + "/") for p in needed):  # covering it would hide our own code
            report["errors"].append(f"{path} not made private: the verifier, Python or the host scratch lives below it")
            continue
        try:
            if path == WORK_DIR:
                os.mkdir(path, 0o711)
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                  f"size={size},nr_inodes={inodes},mode={'0711' if path == WORK_DIR else '1777'}")
            private.append(path)
        except OSError as exc:
            report["errors"].append(str(exc))
    report["private_tmpfs"] = private
    if spaces["ipc"]:
        report["ipc_limits"] = _set_sysctls(IPC_LIMITS)
    if spaces["pid"]:
        report["memfd_noexec"] = bool(_set_sysctls((("vm/memfd_noexec", "2"),)))
    readonly, skipped = 0, 0
    points = _mount_points()
    writable = set(private)
    if WORK_DIR not in private:  # work directories stay in the host scratch: its mount must stay writable
        scratch = os.path.realpath(host_scratch) + "/"
        writable.add(max((p for p, _ in points if scratch.startswith(p.rstrip("/") + "/")), key=len, default="/"))
    for point, options in reversed(points):
        if point in writable or point == "/proc" or point.startswith("/proc/") or "ro" in options:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for name, bit in MOUNT_FLAG_BITS.items():
            flags |= bit if name in options else 0
        try:
            mount(None, point, None, flags, None)
            readonly += 1
        except OSError:
            skipped += 1
    report["readonly_remounts"], report["readonly_failed"] = readonly, skipped


def _set_sysctls(settings: tuple[tuple[str, str], ...]) -> list[str]:
    done = []
    for name, value in settings:
        try:
            _write("/proc/sys/" + name, value)
            done.append(name)
        except OSError:
            pass
    return done


def _become_zygote(config: dict[str, Any], spaces: dict[str, bool], parent: int) -> None:
    """In the forked child (PID 1 of the new PID namespace, if any): finish the isolation, then exec."""
    report: dict[str, Any] = {"namespaces": spaces, "errors": [], "private_proc": False, "private_tmpfs": [],
                              "ipc_limits": [], "memfd_noexec": False, "readonly_remounts": 0}
    try:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() not in (parent, 0):  # 0: the parent lives outside our new PID namespace
            os._exit(1)
        if spaces["mount"]:
            setup_mounts(spaces, report, config["scratch"])
    except OSError as exc:
        report["errors"].append(str(exc))
        report["private_tmpfs"], report["private_proc"] = [], False
    config["sandbox"] = report
    if WORK_DIR in report["private_tmpfs"]:
        config["scratch"] = WORK_DIR  # the host scratch directory is not used at all
    os.chdir("/")
    os.execv(sys.executable, [sys.executable, "-I", "-S", "-B", ZYGOTE_SCRIPT, json.dumps(config)])


def main() -> None:
    config = json.loads(sys.argv[1])
    spaces = create_namespaces(os.geteuid() == 0) if config.get("isolate", True) else \
        {"user": False, "mount": False, "ipc": False, "net": False, "pid": False}
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            _become_zygote(config, spaces, parent)
        finally:
            os._exit(71)

    def _stop(_signum: int, _frame: Any) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _stop)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


if __name__ == "__main__":
    main()
