"""First stage of every sandbox server: namespaces, a private root, the seccomp allowlist, then exec of the zygote.

Why a separate script: Python 3.11 has no `os.unshare`/`mount`, so this uses ctypes on libc (and on libseccomp, see
seccomp.py). It is our own trusted code and runs before any candidate exists; `execv` then replaces the interpreter.

    parent --Popen--> python -I -S -B launcher.py CONFIG          (this file; stays as the waiting parent)
                        unshare(user?) mount ipc net pid, each tried on its own (what works is reported)
                        fork --> PID 1 of the new PID namespace:
                                 private root: a tmpfs holding only the interpreter, its lib directory (standard
                                 library; site-packages masked), system libraries, /usr/share/zoneinfo, four
                                 devices and copies of the sandbox scripts; pivot_root into it, old root detached
                                 (the project's sources, e.g. the tasks' reference solutions, are not there at all);
                                 fresh /proc (hidepid=2), tmpfs (noexec,nosuid,nodev, size-capped) on /tmp,
                                 /var/tmp, /dev/shm and the work area, IPC object limits 0, memfd noexec,
                                 every other mount read-only; the zygote's staging pipe created and sized;
                                 seccomp allowlist loaded (inherited by the zygote and every child it forks)
                                 execv python -I -S -B /verifier/zygote.py CONFIG+report

The waiting parent turns SIGTERM/SIGINT/SIGHUP into SIGKILL of the zygote (whose death ends the PID namespace with
every process in it) and exits with the zygote's status. Anything that fails is recorded and skipped: the zygote
then runs with less isolation, `Verifier.protections` says so, and the Verifier refuses to run untrusted code unless
the caller opted in to a weaker sandbox (docs/verifier.md, "Fallback").
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # -I keeps the script's directory off sys.path
import freshtmp  # noqa: E402
import procview  # noqa: E402
import seccomp  # noqa: E402

sys.path.remove(HERE)
ZYGOTE_SCRIPT = os.path.join(HERE, "zygote.py")
# What the zygote needs of this directory; copied into the private root (the project itself is never visible there).
SANDBOX_MODULES = ("zygote.py", "child.py", "cleanup.py", "guards.py", "protocol.py")
ROOT_SCRIPT_DIR = "/verifier"
PROC_STORE = "/verifier/proc"  # the synthetic /proc files (procview.py), in the private root's own tmpfs
# Host paths the private root shows read-only besides the interpreter and its lib directory: shared libraries the
# standard library's extension modules link against, the loader cache and the time zone database (zoneinfo).
SYSTEM_PATHS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32", "/usr/share/zoneinfo",
                "/etc/ld.so.cache")
DEVICES = ("null", "zero", "urandom", "random")
ROOT_CANDIDATES = ("/mnt", "/srv", "/media", "/opt", "/boot", "/home", "/var")  # where the new root is assembled
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
MNT_DETACH = 2

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


def _bind(source: str, target: str, executable: bool = False) -> None:
    """Read-only bind mount of one host path (file or directory) at `target` (created first). `executable`: try to
    drop the source mount's noexec (the resident copy may live on a noexec /dev/shm; real root may do that)."""
    if os.path.isdir(source):
        os.makedirs(target, 0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
    mount(source, target, None, MS_BIND, None)
    present = os.statvfs(target).f_flag  # keep the source mount's nodev/noexec (a user namespace may not drop them)
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
    flags |= (MS_NODEV if present & os.ST_NODEV else 0)
    if executable:
        try:
            mount(None, target, None, flags, None)
            return
        except OSError:
            pass
    mount(None, target, None, flags | (MS_NOEXEC if present & os.ST_NOEXEC else 0), None)


def _write_accounts(etc: str, uids: list[int], gid: int) -> None:
    """/etc/passwd and /etc/group of the private root: an entry for every uid a job of this server may run as, so
    `getpass.getuser()` and `pwd.getpwuid(os.getuid())` work for honest code (glibc reads files when nsswitch.conf
    is absent)."""
    with open(os.path.join(etc, "passwd"), "w") as fh:
        fh.write("root:x:0:0:root:/root:/usr/sbin/nologin\n")
        fh.writelines(f"sandbox:x:{uid}:{gid}:verifier candidate:/tmp:/usr/sbin/nologin\n" for uid in uids)
    with open(os.path.join(etc, "group"), "w") as fh:
        fh.write(f"root:x:0:\nsandbox:x:{gid}:\n")


def pivot_to_private_root(report: dict[str, Any], config: dict[str, Any] | None = None) -> str:
    """Assemble a root that holds only the interpreter, its standard library, system libraries, a few devices and
    copies of the sandbox scripts, and pivot into it. The host file system (this project's sources, e.g. the tasks'
    reference solutions, the caller's files, other users' files) is then unreachable from the zygote and every child.
    Returns the zygote script's path inside the new root."""
    python = os.path.realpath(sys.executable)
    lib = os.path.realpath(os.path.join(sys.base_prefix, "lib"))
    resident = (config or {}).get("resident_root")  # residentroot.py: private tmpfs copies instead of host binds
    sources = [python, lib] + [p for p in SYSTEM_PATHS if os.path.lexists(p)] + ([resident] if resident else [])
    base = next((d for d in ROOT_CANDIDATES if os.path.isdir(d) and not os.path.islink(d)
                 and not any(p == d or p.startswith(d + "/") for p in sources)), None)
    if base is None:
        raise OSError(0, "no directory to assemble the private root in")
    mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,nr_inodes=4096,mode=0755")
    old_umask = os.umask(0o022)
    try:
        for path in SYSTEM_PATHS:
            if os.path.islink(path):  # merged /usr: /lib -> usr/lib
                os.makedirs(base + os.path.dirname(path), 0o755, exist_ok=True)
                os.symlink(os.readlink(path), base + path)
            elif resident is None and os.path.exists(path) and not os.path.exists(base + path):
                _bind(path, base + path)
        if resident is not None:  # the copy mirrors absolute paths: bind its top-level directories
            for entry in sorted(os.listdir(resident)):
                if entry == "etc":
                    for name in os.listdir(os.path.join(resident, entry)):
                        _bind(os.path.join(resident, entry, name), base + "/etc/" + name)
                else:
                    _bind(os.path.join(resident, entry), base + "/" + entry, executable=True)
            report["resident_root"] = True
        else:
            _bind(lib, base + lib)
            site = os.path.join(lib, f"python{sys.version_info[0]}.{sys.version_info[1]}", "site-packages")
            if os.path.isdir(site):  # installed packages are not part of what candidates may use
                mount("tmpfs", base + site, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY,
                      "size=4k,mode=0755")
            _bind(python, base + python)
        for name in DEVICES:
            _bind("/dev/" + name, base + "/dev/" + name)
        os.symlink("/proc/self/fd", base + "/dev/fd")
        for path in ("/proc", "/tmp", "/var/tmp", "/dev/shm", "/etc"):
            os.makedirs(base + path, 0o755, exist_ok=True)
        if config and config.get("uid_block"):
            first, count = (int(x) for x in config["uid_block"])
            _write_accounts(base + "/etc", list(range(first, first + count)), int(config.get("gid") or 65534))
        else:  # no uid pool: the fixed sandbox uid, or (without root) the caller's own uid in its user namespace
            uid = (config or {}).get("uid")
            _write_accounts(base + "/etc", [os.getuid() if uid is None else int(uid)],
                            int((config or {}).get("gid") or os.getgid()))
        os.chmod(base + "/tmp", 0o1777)
        scripts = base + ROOT_SCRIPT_DIR
        os.makedirs(scripts, 0o755)
        for name in SANDBOX_MODULES:
            with open(os.path.join(HERE, name), "rb") as src, open(os.path.join(scripts, name), "wb") as dst:
                dst.write(src.read())
    finally:
        os.umask(old_umask)
    os.chdir(base)
    _check(_libc.syscall(ctypes.c_long(PIVOT_ROOT[os.uname().machine]), b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", ctypes.c_int(MNT_DETACH)), "umount old root")
    os.chdir("/")
    report["private_root"] = sorted(os.listdir("/"))
    return os.path.join(ROOT_SCRIPT_DIR, "zygote.py")


def _mount_points() -> list[tuple[str, set[str]]]:
    """(mount point, per-mount options) from /proc/self/mountinfo, parents before children."""
    out = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            fields = line.split()
            if len(fields) > 5 and "\\" not in fields[4]:
                out.append((fields[4], set(fields[5].split(","))))
    return out


def setup_mounts(spaces: dict[str, bool], report: dict[str, Any], host_scratch: str, private_root: bool,
                 python: str, config: dict[str, Any] | None = None) -> str:
    """A private root (with PID namespace), private tmpfs for every writable place, a fresh /proc, everything else
    read-only (in our namespace only). `python`: the interpreter's real path, resolved on the host before the pivot
    (inside the private root a virtual environment's path, e.g. /tmp/clone/.venv/bin/python, does not exist, so
    resolving it there kept its /tmp prefix and the sandbox gave up its private /tmp). Returns the zygote script's
    path."""
    mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    script = ZYGOTE_SCRIPT
    if spaces["pid"] and private_root:  # a fresh /proc needs the PID namespace; so does hiding the host
        try:
            script = pivot_to_private_root(report, config)
        except (OSError, KeyError) as exc:
            report["errors"].append(f"private root: {exc}")
    if spaces["pid"]:
        try:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
            report["private_proc"] = True
        except OSError as exc:
            report["errors"].append(str(exc))
    off = set((config or {}).get("defences_off", ()))
    if report["private_proc"] and report["private_root"] and "proc_view" not in off:
        try:
            with open("/proc/cpuinfo") as fh:
                cpuinfo = fh.read()
            report["proc_view"] = procview.install(mount, PROC_STORE, int((config or {}).get("memory_mb", 256)),
                                                   os.cpu_count() or 1, cpuinfo)
        except OSError as exc:
            report["errors"].append(f"proc view: {exc}")
    private = []
    needed = [os.path.dirname(script) + "/", python]
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
    return script


def _set_sysctls(settings: tuple[tuple[str, str], ...]) -> list[str]:
    done = []
    for name, value in settings:
        try:
            _write("/proc/sys/" + name, value)
            done.append(name)
        except OSError:
            pass
    return done


def _staging_pipe(wanted: int) -> list[int]:
    """The zygote's kernel staging pipe for results, sized here: the allowlist refuses F_SETPIPE_SZ afterwards (a
    candidate could otherwise pin 1 MiB of kernel memory per pipe). Inherited by the zygote across execv."""
    read_fd, write_fd = os.pipe()
    for size in (4 * wanted, 2 * wanted, wanted):  # slack: spliced pages may be partly filled
        try:
            fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, size)
            break
        except OSError:
            continue
    for fd in (read_fd, write_fd):
        os.set_inheritable(fd, True)
    return [read_fd, write_fd]


def _become_zygote(config: dict[str, Any], spaces: dict[str, bool], parent: int) -> None:
    """In the forked child (PID 1 of the new PID namespace, if any): finish the isolation, then exec."""
    report: dict[str, Any] = {"namespaces": spaces, "errors": [], "private_proc": False, "private_tmpfs": [],
                              "ipc_limits": [], "memfd_noexec": False, "readonly_remounts": 0, "private_root": None,
                              "seccomp": None, "proc_view": None, "resident_root": False}
    script = ZYGOTE_SCRIPT
    python = os.path.realpath(sys.executable)  # resolved on the host, before any pivot
    try:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() not in (parent, 0):  # 0: the parent lives outside our new PID namespace
            os._exit(1)
        if spaces["mount"]:
            script = setup_mounts(spaces, report, config["scratch"], bool(config.get("private_root", True)), python,
                                  config)
    except OSError as exc:
        report["errors"].append(str(exc))
        report["private_tmpfs"], report["private_proc"] = [], False
    config["sandbox"] = report
    if WORK_DIR in report["private_tmpfs"]:
        config["scratch"] = WORK_DIR  # the host scratch directory is not used at all
    os.chdir("/")
    config["stage_fds"] = _staging_pipe(int(config.get("max_result_bytes", 1 << 20)))
    fresh = config.pop("fresh_tmpfs_fds", None)
    if fresh and WORK_DIR in report["private_tmpfs"] and "fresh_tmpfs" not in config.get("defences_off", ()):
        for fd in fresh:
            os.set_inheritable(fd, True)
        config["fresh_tmpfs_fds"] = fresh  # the zygote asks the waiting launcher for new tmpfs after each job
    if config.get("seccomp", True):  # last: from here on only what the allowlist permits (execve included)
        try:
            report["seccomp"] = seccomp.install(frozenset(config.get("defences_off", ())))
        except (OSError, AttributeError) as exc:
            report["errors"].append(f"seccomp: {exc}")
        config["sandbox"] = report
    os.execv(python, [python, "-I", "-S", "-B", script, json.dumps(config)])


def main() -> None:
    config = json.loads(sys.argv[1])
    if config.get("seccomp", True):
        try:
            seccomp._library()  # before the pivot: libseccomp is not part of the private root
        except OSError:
            pass  # reported by install() later
    if config.get("lease_fd") is not None:  # the uid block's lease (uids.py): held by this waiting process only,
        os.set_inheritable(int(config["lease_fd"]), False)  # so it ends when the last process of the server is gone
    spaces = create_namespaces(os.geteuid() == 0) if config.get("isolate", True) else \
        {"user": False, "mount": False, "ipc": False, "net": False, "pid": False}
    parent = os.getpid()
    requests_r, requests_w = os.pipe()  # zygote -> launcher: "give this job fresh tmpfs" (freshtmp.py)
    replies_r, replies_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(requests_r)
            os.close(replies_w)
            config["fresh_tmpfs_fds"] = [requests_w, replies_r] if spaces["mount"] else None
            _become_zygote(config, spaces, parent)
        finally:
            os._exit(71)
    os.close(requests_w)
    os.close(replies_r)

    def _stop(_signum: int, _frame: Any) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _stop)

    def _fresh(paths: list[str]) -> bool:
        return freshtmp.remount(mount, _umount_detached, paths, TMPFS, WORK_DIR)

    status = freshtmp.serve(pid, requests_r, replies_w, _fresh)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _umount_detached(path: str) -> None:
    _check(_libc.umount2(path.encode(), ctypes.c_int(MNT_DETACH)), f"umount {path}")


if __name__ == "__main__":
    main()
