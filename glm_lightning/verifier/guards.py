"""The in-process guard: a `sys.addaudithook` installed in the sandbox child before candidate code runs.

What it is for now: clear error messages for honest code, not security. The threat model (docs/verifier.md) assumes
the candidate runs arbitrary native code inside its child, and CPython is not a sandbox: such a candidate can rewrite
this hook or the data it checks. Every guarantee therefore comes from the kernel (private root, namespaces, the
seccomp allowlist in seccomp.py, the unprivileged uid, rlimits; see launcher.py, child.py and zygote.py), and the
test suite checks the kernel layer with this hook switched off. What the hook adds: an operation the kernel would
refuse anyway (a subprocess, a network socket, ctypes, a write outside the working directory...) ends the candidate
at once with `error` and a one-line reason ("forbidden operation: subprocess.Popen") instead of an obscure OSError
deep in a library, and a policy that probes for holes is told plainly that there is none to find.

A forbidden operation is fatal: the hook writes one ["viol", reason] record straight to the result pipe and ends the
process with EXIT_VIOLATION, an exit status the zygote observes from outside. It refuses:

* process creation and signalling: os.system/exec*/spawn*/posix_spawn/fork/forkpty, subprocess.Popen, os.kill;
* network sockets (a local AF_UNIX socket pair, asyncio's self-pipe, is allowed); ctypes/cffi and other native-code
  back doors (their import and their events); extension modules from anywhere but the standard library;
  `os.mkfifo/mknod/memfd_create` are removed from `os` and `posix`, and re-importing those modules is refused;
* debugging hooks: sys.settrace/setprofile, gc.get_objects/get_referrers/get_referents, sys._current_frames,
  sys.addaudithook; sqlite3 extension loading (in-memory and working-directory databases are fine);
* file system: writes, renames, deletes, chmod... anywhere outside the private working directory, links and chdir;
  fd and dir_fd arguments are judged by the path the fd points to (readlink of /proc/self/fd/N). Reads are checked
  only without the private root (then: the working directory and the standard library); in the private root the
  kernel shows nothing else, so `zoneinfo` and `mimetypes` work.

Frames are not hidden (tracebacks and `logging` need them): one job per process, so a child's own frames hold
nothing of any other job. The hook only closes over values captured at install time and unbound methods of
built-in types, and never calls candidate objects. Stdlib only: this module runs inside the sandbox.
"""

from __future__ import annotations

import os
import sys
BLOCKED_EVENTS = frozenset(
    {
        "os.system", "os.fork", "os.forkpty", "os.posix_spawn", "os.kill", "os.killpg", "os.chdir", "os.fchdir",
        "os.chroot", "os.link", "os.symlink", "os.startfile", "os.setxattr", "os.removexattr", "os.chflags",
        "os.lchflags", "pty.spawn", "signal.pthread_kill", "subprocess.Popen", "sys.addaudithook", "sys.settrace",
        "sys.setprofile", "sys._current_frames", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
        "resource.prlimit", "webbrowser.open", "msvcrt.open_osfhandle", "sqlite3.enable_load_extension",
        "sqlite3.load_extension",
    }
)
BLOCKED_PREFIXES = ("os.exec", "os.spawn", "socket.", "ctypes.", "_ctypes.", "cffi.", "urllib.", "ftplib.",
                    "http.", "smtplib.", "poplib.", "imaplib.", "nntplib.", "telnetlib.", "syslog.")
BLOCKED_IMPORTS = frozenset({"ctypes", "_ctypes", "cffi", "_cffi_backend", "_xxsubinterpreters",
                             "_xxinterpchannels", "_testcapi", "_testinternalcapi", "_tkinter", "readline",
                             "_posixshmem", "_multiprocessing", "mmap", "_imp", "posix", "os", "_io", "sys",
                             "builtins", "_thread", "gc", "_signal"})
REMOVED_FUNCTIONS = ("mkfifo", "mknod", "memfd_create")
EXIT_VIOLATION = 77
AF_UNIX = 1
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
PATH_WRITE_EVENTS = frozenset({"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate",
                               "os.utime", "os.mkfifo", "os.mknod"})
READABLE_DEVICES = ("/dev/null", "/dev/urandom", "/dev/random", "/dev/zero")
MAX_WRITE_OPENS = 64  # with RLIMIT_FSIZE = 1 MiB this bounds what one candidate can put on disk (or in tmpfs)


class SandboxViolation(PermissionError):
    """Kept for compatibility: violations are now fatal (EXIT_VIOLATION) and never raised into candidate code."""


def stdlib_roots() -> tuple[str, ...]:
    """Directories candidate code may read from: the standard library (imports read .py/.pyc files)."""
    roots = []
    for entry in sys.path:
        if entry and os.path.isabs(entry):
            real = os.path.realpath(entry)
            roots.extend(p for p in {entry, real} if p not in roots)
    return tuple(roots)


def remove_functions() -> None:
    """Functions that create files or executable memory without raising an audit event: take them away.

    Called once in the zygote before any fork (so no child pays for it), and again by `install` (idempotent)."""
    import posix

    if not any(name in module.__dict__ for module in (os, posix) for name in REMOVED_FUNCTIONS):
        return  # already done in the zygote: do not even scan __all__ (that would touch ~300 shared strings)
    for module in (os, posix):
        for name in REMOVED_FUNCTIONS:
            if name in module.__dict__:
                del module.__dict__[name]
        names = getattr(module, "__all__", None)
        for name in REMOVED_FUNCTIONS if type(names) is list else ():  # keep `from os import *` working
            while name in names:
                names.remove(name)


def install(workdir: str, read_roots: tuple[str, ...], result_fd: int, reads_anywhere: bool = False) -> None:
    """Install the audit hook. A violation writes one record to `result_fd` and exits with EXIT_VIOLATION.

    reads_anywhere: the child runs in the private root, where the kernel already shows nothing but the interpreter,
    the standard library, system libraries and its own directory; reads are then not second-guessed here (that is
    what lets `zoneinfo` and `mimetypes` work)."""
    remove_functions()
    _type, _str, _bytes, _int = type, str, bytes, int
    _startswith = str.startswith
    _split = str.split
    _partition = str.partition
    _decode = bytes.decode
    _str_encode = str.encode
    _hex = bytes.hex
    _len = len
    _OSError, _BaseException = OSError, BaseException
    _readlink = os.readlink
    _write, _exit = os.write, os._exit
    _fd, _exit_code = result_fd, EXIT_VIOLATION
    _blocked, _prefixes, _blocked_imports = BLOCKED_EVENTS, BLOCKED_PREFIXES, BLOCKED_IMPORTS
    _write_events, _write_flags = PATH_WRITE_EVENTS, WRITE_FLAGS
    _reads_anywhere, _af_unix = bool(reads_anywhere), AF_UNIX
    _devices = READABLE_DEVICES
    write_opens = [MAX_WRITE_OPENS]
    _workdir = workdir
    _workdir_slash = workdir + "/"
    _roots = tuple(r + "/" for r in read_roots)

    def _fd_path(fd: int) -> str | None:
        """Path of an open fd (a directory fd used with dir_fd=, or os.scandir(fd)); pipes etc. give None."""
        try:
            target = _readlink("/proc/self/fd/" + _str(fd))
        except _OSError:
            return None
        return target if _type(target) is _str and _startswith(target, "/") else None

    def _normalise(path: object, dir_fd: object = None) -> str | None:
        """Absolute, '..'-free path string, or None when the path is not something we can judge safely."""
        if _type(path) is _int:
            return _fd_path(path) if dir_fd is None else None
        if _type(path) is _bytes:
            path = _decode(path, "utf-8", "surrogateescape")
        if _type(path) is not _str:
            return None
        if not _startswith(path, "/"):
            if dir_fd is None or dir_fd == -1:
                path = _workdir_slash + path
            elif _type(dir_fd) is _int:
                base = _fd_path(dir_fd)
                if base is None:
                    return None
                path = base + "/" + path
            else:
                return None
        if ".." in _split(path, "/"):
            return None
        return path

    def _may_write(path: object, dir_fd: object = None) -> bool:
        p = _normalise(path, dir_fd)
        return p is not None and (p == _workdir or _startswith(p, _workdir_slash))

    def _may_read(path: object, dir_fd: object = None) -> bool:
        if _reads_anywhere:
            return True
        p = _normalise(path, dir_fd)
        if p is None:
            return False
        return p == _workdir or _startswith(p, _workdir_slash) or _startswith(p + "/", _roots) or p in _devices

    def _deny(event: str, what: object = "") -> None:
        """Fatal: report over the result pipe, then end the process. Never returns."""
        try:
            message = event + " " + what[:120] if _type(what) is _str and what else event
            record = '\n["viol",["s","' + _hex(_str_encode(message, "utf-8", "replace")) + '"]]\n'
            _write(_fd, _str_encode(record, "ascii"))
        except _BaseException:
            pass
        _exit(_exit_code)

    def hook(event: str, args: tuple) -> None:
        if event == "exec" or event == "compile":
            return
        if event == "object.__getattr__" or event == "sys._getframe":
            return  # the child's own frames hold nothing of any other job (one job per process)
        if event == "socket.__new__" and _len(args) > 1 and args[1] == _af_unix:
            return  # a local socket (asyncio's self-pipe); the network namespace and seccomp decide the rest
        if event == "sqlite3.connect":
            database = args[0] if args else None
            if database in (":memory:", "", b":memory:", b"") or _may_write(database):
                return
            _deny(event, database if _type(database) is _str else "<non-str path>")
        if event in _blocked or _startswith(event, _prefixes):
            _deny(event)
        if event == "import":
            name = args[0]
            if _type(name) is not _str or _partition(name, ".")[0] in _blocked_imports:
                _deny(event, name if _type(name) is _str else "<non-str name>")
            if _len(args) > 1 and args[1] is not None:  # an extension module: only from the standard library
                origin = args[1]
                if _type(origin) is not _str or _may_write(origin) or not _may_read(origin):
                    _deny("extension module", origin if _type(origin) is _str else "<non-str path>")
            return
        if event == "open":
            path, mode, flags = args[0], args[1], args[2]
            writing = _type(flags) is _int and flags & _write_flags
            if _type(mode) is _str and ("w" in mode or "a" in mode or "x" in mode or "+" in mode):
                writing = True
            if writing and mode is None and _type(path) is not _int and not (
                    _type(path) is _str and _startswith(path, "/") or _type(path) is _bytes and path[:1] == b"/"):
                _deny(event, "relative os.open for writing (dir_fd is not visible to the guard)")
            if not (_may_write(path) if writing else _may_read(path)):
                _deny(event, path if _type(path) is _str else "<non-str path>")
            if writing:
                write_opens[0] -= 1
                if write_opens[0] < 0:
                    _deny(event, "too many files opened for writing")
            return
        if event == "os.rename":
            if not (_may_write(args[0], args[2]) and _may_write(args[1], args[3])):
                _deny(event, "outside the working directory")
            return
        if event in _write_events:
            dir_fd = args[-1] if _len(args) > 1 and event != "os.truncate" else None
            if not _may_write(args[0], dir_fd):
                _deny(event, args[0] if _type(args[0]) is _str else "<fd or non-str path>")
            return
        if event == "os.listdir" or event == "os.scandir":
            if args[0] is not None and not _may_read(args[0]):
                _deny(event, args[0] if _type(args[0]) is _str else "<non-str path>")
            return

    sys.addaudithook(hook)
