"""Code that runs in the forked sandbox child: confine the process, then run one candidate against its test inputs.

Stdlib only; imported by the zygote as a top-level module (see zygote.py), never by the trainer. Order matters:

0. `read_job`: the freshly forked child reads exactly one length-prefixed job frame from stdin (never a byte more:
   the next job stays in the kernel pipe), reports "started" on a private control pipe and closes that pipe.
1. `confine`: new process group, stdin/stdout/stderr -> /dev/null, every other fd closed except the result
   pipe (moved to a random high number), cwd = a private empty directory, environment cleared, rlimits with
   soft == hard (CPU, address space, file size, open files, processes, queued signals, core dumps), then the uid is
   dropped to an unprivileged one (as root RLIMIT_NPROC and file permissions would otherwise protect nothing).
2. Test inputs are decoded and the result encoder is built *before* candidate code exists.
3. `guards.install` adds the audit hook (irremovable).
4. The candidate is compiled and executed; the entry point is called once per test input. After each call the raw
   return value is serialised immediately, checking exact types on the real object.

Result stream (one JSON array per line, written to the private fd; see judge.py for how the parent reads it):
    ["t", <monotonic time: setup done>]
    ["invalid", <tagged str reason>]          compile error / entry point missing or not a function
    ["crash", <tagged str exception name>]    exception while executing the module body
    ["v", i, <tagged value>] | ["x", i, <tagged str exception name>]    one per test, in order
    ["viol", <tagged str>]                    first blocked operation, if any
    ["end", "<nonce>", <number of tests run>, <monotonic time>]
The expected outputs never enter this process, and the exit status is ignored by the parent.
"""

from __future__ import annotations

import builtins
import marshal
import os
import resource
import sys
import time
import types
from typing import Any, NoReturn

try:  # package import (documentation tools, tests) vs. top-level import inside the zygote
    from . import guards, protocol
except ImportError:  # pragma: no cover - exercised inside the zygote
    import guards  # type: ignore[no-redef]
    import protocol  # type: ignore[no-redef]

FILE_SIZE_LIMIT = 1 << 20
OPEN_FILES_LIMIT = 64
RESULT_FD_RANGE = (200, 1000)  # the result pipe is moved to a random fd in this range
EXIT_INTERNAL_ERROR = 70
EXIT_NO_JOB = 72  # stdin closed before a job arrived: the zygote shuts down
FRAME_HEADER = 11  # b"%010d\n"
MAX_FRAME_BYTES = 64 << 20


def _setrlimit(which: int, value: int) -> None:
    """soft == hard, so candidate code cannot raise it again; never above the inherited hard limit."""
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


def _close_all_but(keep: set[int]) -> None:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    top = max(soft if soft != resource.RLIM_INFINITY else 4096, max(keep) + 1)
    low = 3
    for fd in sorted(keep) + [top]:
        if fd > low:
            os.closerange(low, fd)
        low = max(low, fd + 1)


def packages_under(roots: list[str]) -> list[tuple[list, int, str]]:
    """(__path__ list, index, entry) for every imported package entry under `roots`. Computed once in the zygote,
    so children do not have to walk (and copy-on-write fault) every module object."""
    found = []
    for module in list(sys.modules.values()):
        paths = getattr(module, "__path__", None)
        if type(paths) is not list:
            continue
        for i, entry in enumerate(paths):
            if any(entry == root or entry.startswith(root + "/") for root in roots):
                found.append((paths, i, entry))
    return found


def _redirect_package_paths(by_path: dict[str, str], packages: list[tuple[list, int, str]]) -> None:
    """Packages imported before the fork (encodings, collections, json...) find submodules via their own
    __path__, not sys.path: point those at the /proc/self/fd roots too (e.g. `"x".encode("cp1252")`)."""
    for paths, i, entry in packages:
        for root, via in by_path.items():
            if entry == root or entry.startswith(root + "/"):
                paths[i] = via + entry[len(root):]
                break


def confine(result_fd: int, workdir: str, config: dict[str, Any]) -> tuple[int, tuple[str, ...]]:
    """Apply every OS-level restriction to this (freshly forked) process.

    Returns the new result fd and the directories candidate code may import from. The standard library may live
    under a directory the unprivileged uid cannot traverse (here: /root/.pyenv, /root is 0700), so directory fds are
    opened *before* the uid drop and sys.path is pointed at /proc/self/fd/N: the kernel resolves those links without
    checking the ancestors, so imports keep working while the rest of the tree stays unreadable.
    """
    try:  # a process group of its own (not setsid: a new session costs ~0.7 ms for a new scheduler autogroup,
        os.setpgid(0, 0)  # and the zygote has no controlling terminal to detach from)
    except OSError:
        pass
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    soft_nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    high = RESULT_FD_RANGE[1] if soft_nofile == resource.RLIM_INFINITY else min(RESULT_FD_RANGE[1], soft_nofile)
    low = min(RESULT_FD_RANGE[0], high - 1)
    target = low + int.from_bytes(os.urandom(2), "little") % max(1, high - low)
    if target != result_fd:
        os.dup2(result_fd, target, inheritable=False)
        os.close(result_fd)
    dir_fds: list[tuple[str, int]] = []
    uid = config.get("uid")
    for path in config.get("read_roots", ()) if uid is not None else ():  # only needed after a uid drop
        try:
            dir_fds.append((path, os.open(path, os.O_RDONLY | os.O_DIRECTORY)))
        except OSError:
            pass
    _close_all_but({target, *(fd for _, fd in dir_fds)})
    os.chdir(workdir)
    # The zygote cleared its environment at start-up (and was started with a minimal one), so children inherit an
    # empty one; HOME and TMPDIR point at the private directory so that tempfile & co. stay inside it.
    os.environ["HOME"] = os.environ["TMPDIR"] = workdir
    timeout_s = float(config["timeout_s"])
    _setrlimit(resource.RLIMIT_CPU, int(timeout_s) + 2)
    _setrlimit(resource.RLIMIT_AS, int(config["memory_mb"]) << 20)
    _setrlimit(resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT)
    _setrlimit(resource.RLIMIT_NOFILE, OPEN_FILES_LIMIT)
    _setrlimit(resource.RLIMIT_NPROC, 0)
    _setrlimit(resource.RLIMIT_CORE, 0)
    # No queued real-time signals: the count of pending signals is per uid, so a candidate filling it would be
    # visible to another one (a channel), and each costs kernel memory. Standard signals are unaffected.
    _setrlimit(resource.RLIMIT_SIGPENDING, 16 if "sigpending" in config.get("defences_off", ()) else 0)
    if uid is not None:
        os.setgroups([])
        os.setgid(int(config["gid"]))
        os.setuid(int(uid))
        if os.getuid() != uid or os.geteuid() != uid:
            raise RuntimeError("failed to drop privileges")
    roots = tuple(path for path, _ in dir_fds)
    via_fd = tuple(f"/proc/self/fd/{fd}" for _, fd in dir_fds)
    if via_fd and os.path.isdir(via_fd[0]):
        by_path = dict(zip(roots, via_fd))
        sys.path[:] = [by_path.get(entry, entry) for entry in sys.path]
        _redirect_package_paths(by_path, config.get("packages", []))
        roots = roots + via_fd
    sys.dont_write_bytecode = True
    return target, roots


FLUSH_INTERVAL_S = 0.05


def _make_emitter(fd: int):
    """Buffered record writer bound to the original os.write (candidate code may replace os.write later).

    Records are flushed in one write at the end, or after a test once FLUSH_INTERVAL_S has passed since the last
    flush: one wake-up of the zygote per fast candidate, yet slow candidates still report partial progress.
    """
    _write, _encode, _join, _len, _append = os.write, str.encode, str.join, len, list.append
    _monotonic = time.monotonic
    _interval = FLUSH_INTERVAL_S
    pending: list = []
    last = [_monotonic()]

    def emit(line: str) -> None:
        _append(pending, line)
        _append(pending, "\n")

    def flush(force: bool = True) -> None:
        if not _len(pending) or (not force and _monotonic() - last[0] < _interval):
            return
        data = _encode(_join("", pending), "ascii", "replace")
        del pending[:]
        while _len(data):
            data = data[_write(fd, data):]
        last[0] = _monotonic()

    return emit, flush


# Built once in the zygote, before any candidate exists (saves work in every child; equally untouched by them).
ENCODE = protocol.make_encoder(strict=False)


def _read_exactly(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        data = os.read(fd, min(left, 1 << 20))
        if not data:
            raise EOFError
        chunks.append(data)
        left -= len(data)
    return b"".join(chunks)


def read_job(fd: int) -> dict[str, Any]:
    """Exactly one frame: b"%010d\\n" % len(body), then the body. Never reads past it.

    The body is `marshal` data from the trusted parent (same interpreter): it keeps exact types (bool/int,
    tuple/list, bytes) without a Python-level decoder, so the child touches (and copy-on-write faults) fewer pages.
    """
    header = _read_exactly(fd, FRAME_HEADER)
    if header[-1:] != b"\n" or not header[:-1].isdigit() or int(header[:-1]) > MAX_FRAME_BYTES:
        raise ValueError("bad job frame")
    job = marshal.loads(_read_exactly(fd, int(header[:-1])))
    if type(job) is not dict:
        raise ValueError("bad job")
    return job


def run_candidate(ctl_fd: int, result_fd: int, workdir: str, config: dict[str, Any], t_fork: float) -> NoReturn:
    """Child entry point after fork. Never returns; always leaves through os._exit."""
    _exit = os._exit
    t_child = time.monotonic()
    try:
        job = read_job(0)
    except EOFError:
        _exit(EXIT_NO_JOB)
    except BaseException:
        _exit(EXIT_INTERNAL_ERROR)
    try:
        report = '{"id":%d,"t_child":%r,"t_job":%r}\n' % (int(job["id"]), t_child, time.monotonic())
        os.write(ctl_fd, report.encode())
        os.close(ctl_fd)
        fd, roots = confine(result_fd, workdir, config)
        inputs = job["inputs"]
        if type(inputs) is not list or any(type(args) is not tuple for args in inputs):
            raise ValueError("inputs must be tuples")
        _run(job, fd, workdir, roots, inputs, bool(config.get("audit_hook", True)),
             bool(config.get("sandbox", {}).get("private_root")))
    except BaseException:
        _exit(EXIT_INTERNAL_ERROR)
    _exit(0)


def _run(job: dict[str, Any], fd: int, workdir: str, roots: tuple[str, ...], inputs: list, hook: bool,
         private_root: bool = False) -> None:
    """Execute the candidate; every reference it needs is bound before candidate code runs."""
    emit, flush = _make_emitter(fd)
    encode = ENCODE
    _type, _str, _range, _FunctionType, _BaseException = type, str, range, types.FunctionType, BaseException
    _monotonic = time.monotonic
    _float_repr = float.__repr__
    _type_name = type.__dict__["__name__"].__get__
    _dict_get = dict.get
    _len = len
    nonce = str(job["nonce"])
    entry = str(job["entry_point"])
    source = job["source"]

    def exc_name(exc: BaseException) -> str:
        try:
            name = _type_name(_type(exc))
        except _BaseException:
            name = "?"
        return encode(name if _type(name) is _str else "?")

    flush()  # nothing pending yet; binds the emitter before the hook exists
    if hook:  # off only in tests that check what the OS layer alone contains
        guards.install(workdir, roots, fd, reads_anywhere=private_root)
    emit('["t",' + _float_repr(_monotonic()) + "]")

    done = 0
    try:
        code = compile(source, "<candidate>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        emit('["invalid",' + encode(f"does not compile: {_type_name(_type(exc))}: {exc}"[:200]) + "]")
        code = None
    except _BaseException as exc:
        emit('["crash",' + exc_name(exc) + "]")
        code = None
    if code is not None:
        # The real builtins module: patching it only affects this single-use process, and every reference the
        # wrapper needs was captured above (copying the dict would copy-on-write fault ~300 objects per child).
        namespace: dict = {"__name__": "__candidate__", "__builtins__": builtins}
        executed = False
        try:
            exec(code, namespace)
            executed = True
        except _BaseException as exc:
            emit('["crash",' + exc_name(exc) + "]")
        if executed:
            fn = _dict_get(namespace, entry)
            if fn is None:
                emit('["invalid",' + encode(f"entry point {entry!r} is not defined") + "]")
            elif _type(fn) is not _FunctionType:
                emit('["invalid",' + encode(f"entry point {entry!r} is not a function") + "]")
            else:
                for i in _range(_len(inputs)):
                    try:
                        value = fn(*inputs[i])
                    except _BaseException as exc:
                        emit('["x",' + _str(i) + "," + exc_name(exc) + "]")
                    else:
                        try:
                            text = encode(value)
                        except _BaseException:
                            text = '["u","' + b"unencodable".hex() + '"]'
                        value = None
                        emit('["v",' + _str(i) + "," + text + "]")
                    done += 1
                    flush(False)
    emit('["end","' + nonce + '",' + _str(done) + "," + _float_repr(_monotonic()) + "]")
    flush()


def probe(result_fd: int, workdir: str, config: dict[str, Any]) -> NoReturn:
    """Start-up self test, run in a child confined exactly like a candidate (without the audit hook).

    Reports what the kernel actually enforces here: the effective uid, whether fork is refused (RLIMIT_NPROC),
    whether a connection to 127.0.0.1 is impossible (network namespace), whether creating a file in the root-owned
    scratch directory fails (file permissions after the uid drop), which temp directories are noexec, how many
    processes /proc shows (1 + us inside our own PID namespace) and whether SysV IPC objects are disabled.
    """
    import json

    report: dict[str, Any] = {}
    fd = result_fd
    try:
        fd, _ = confine(result_fd, workdir, config)
        report["uid"] = os.getuid()
        try:
            pid = os.fork()
        except OSError as exc:
            report["fork_blocked"] = type(exc).__name__
        else:
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
            report["fork_blocked"] = False
        import socket

        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        except OSError as exc:  # the seccomp allowlist refuses network sockets outright
            report["loopback"] = "socket: " + (os.strerror(exc.errno) if exc.errno else type(exc).__name__)
        else:
            sock.settimeout(1.0)
            try:
                sock.connect(("127.0.0.1", 9))
                report["loopback"] = "connected"
            except OSError as exc:
                report["loopback"] = os.strerror(exc.errno) if exc.errno else type(exc).__name__
            finally:
                sock.close()
        try:
            with open("/proc/self/net/dev") as fh:
                report["interfaces"] = sorted(line.split(":")[0].strip() for line in fh.readlines()[2:])
        except OSError:
            report["interfaces"] = None
        outside = os.path.dirname(workdir) + "/probe-outside-" + os.urandom(4).hex()
        try:
            os.close(os.open(outside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError:
            report["outside_write_blocked"] = True
        else:
            os.unlink(outside)
            report["outside_write_blocked"] = False
        report["noexec"] = [p for p in ("/tmp", "/var/tmp", "/dev/shm", workdir)
                            if os.path.isdir(p) and os.statvfs(p).f_flag & os.ST_NOEXEC]
        report["visible_processes"] = sum(name.isdigit() for name in os.listdir("/proc"))
        report["sysv_ipc_disabled"] = _read_first("/proc/sys/kernel/shmmni") == "0" and \
            _read_first("/proc/sys/kernel/msgmni") == "0"
        report["memfd_noexec"] = _read_first("/proc/sys/vm/memfd_noexec")
        report["seccomp_mode"] = _status_field("Seccomp")  # "2": a filter is active (reported by the kernel)
        report["seccomp_filters"] = _status_field("Seccomp_filters")
        report["no_new_privs"] = _status_field("NoNewPrivs")
        report["locks_refused"] = _lock_refused()
        hidden = config.get("hidden_probe")
        report["host_sources_hidden"] = bool(hidden) and not os.path.lexists(hidden)
        report["root_entries"] = sorted(os.listdir("/"))
        try:
            import pwd

            report["passwd_name"] = pwd.getpwuid(os.getuid()).pw_name
        except (KeyError, ImportError):
            report["passwd_name"] = None
        meminfo = (_read_all("/proc/meminfo") or "").split()
        report["meminfo_total_kb"] = int(meminfo[1]) if meminfo[:1] == ["MemTotal:"] else None
        os.write(fd, json.dumps(report).encode() + b"\n")
    except BaseException as exc:  # report what went wrong instead of hanging the handshake
        try:
            os.write(fd, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode() + b"\n")
        except OSError:
            pass
        os._exit(EXIT_INTERNAL_ERROR)
    os._exit(0)


def _status_field(name: str) -> str | None:
    for line in (_read_all("/proc/self/status") or "").splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return None


def _lock_refused() -> bool:
    """A lock on a shared inode (/dev/null: the same inode for every process on the host) must be refused."""
    import fcntl

    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def _read_all(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


def _read_first(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().split("\n")[0].strip()
    except OSError:
        return None
