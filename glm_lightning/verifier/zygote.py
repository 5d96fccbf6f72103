"""The sandbox server ("zygote"): a clean, single-threaded interpreter that forks one child per candidate.

Why: forking the (multithreaded) trainer can deadlock and would copy its memory, secrets and open files into the
child, while a fresh interpreter per candidate costs tens of ms of CPU. So the parent starts launcher.py once per
worker (namespaces, private root, private tmpfs, seccomp allowlist), which execs this script; this process then
forks one confined child per job.

One job per child, and no job ever passes through this process: the zygote forks the child *first*, and the child
itself reads exactly one length-prefixed job frame from stdin (never more), tells the zygote on a private control
pipe that it has started, and closes stdin before candidate code runs. The child's result bytes are moved to the
parent with splice(2) through a kernel staging pipe, so neither jobs nor results of other candidates are ever in
this process's memory, and so never in the memory a later child inherits.

Protocol on stdin/stdout:
    parent -> child:  b"%010d\\n" % len(body) + body, body = marshal of {"id", "source", "entry_point",
                      "inputs" (argument tuples), "nonce"}; EOF means shut down.
    zygote -> parent: first a hello line {"hello": 1, "probe": {...}, ...}; then per job one JSON header line
                      {"id", "exit", "timed_out", "truncated", "n", "t_fork", "t_child", "t_job", "t_exit", "t_done",
                      "cleanup_ok"} followed by exactly n raw bytes: what the child wrote to its result pipe (capped).
The zygote only relays bytes, enforces the wall-clock limit and cleans up; the trusted parent interprets the bytes.

Stdlib only. Runs as a script, so it imports its siblings as top-level modules and then removes its own directory
from sys.path again.
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import select
import signal
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import child  # noqa: E402
import cleanup  # noqa: E402
import guards  # noqa: E402

sys.path.remove(HERE)

# Imported once here so that candidates importing them pay nothing after fork. Kept small on purpose: every
# preloaded module makes each fork (page tables) and each child (copy-on-write faults) more expensive, and e.g.
# `random` drags in OpenSSL. Anything else is still importable on demand from the standard library.
PRELOAD = ("math", "re", "itertools", "functools", "collections", "string", "heapq", "bisect", "operator", "copy",
           "typing")
DEFAULT_MAX_RESULT_BYTES = 1 << 20
PROBE_TIMEOUT_S = 5.0
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")
REAP_WAIT_S = 1.0
FRESH_TMPFS_WAIT_S = 5.0


class Zygote:
    """Fork-per-job server state: configuration, staging pipe, scratch directory and a job counter."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.scratch = config["scratch"]
        self.timeout_s = float(config.get("timeout_s", 2.0))
        self.counter = 0
        # Child exits wake the supervision loop through SIGCHLD and a wake-up pipe (pidfds are denied by the
        # seccomp allowlist: a candidate must not get them either).
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.signal(signal.SIGCHLD, _ignore)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        self.current_pid: int | None = None
        self.pid1 = os.getpid() == 1
        private = config.get("sandbox", {}).get("private_tmpfs", [])
        self.wipe_dirs = [p for p in SHARED_TMP if p in private]  # ours to empty: private to this namespace
        self.clean_stamp: dict[str, tuple[int, int]] = {}  # (mtime, ctime) of each after its last wipe
        self.sweep_dirs = [p for p in SHARED_TMP if p not in private and config.get("uid") is not None]
        block = config.get("uid_block")
        self.uid_block = (int(block[0]), int(block[1])) if block else None
        self.sandbox_uids = range(block[0], block[0] + block[1]) if block else range(0)
        # issue 46: fresh tmpfs per job from the launcher (freshtmp.py); None: empty the directories instead
        fresh = config.get("fresh_tmpfs_fds")
        self.fresh = (int(fresh[0]), int(fresh[1])) if fresh else None
        self.fresh_paths = [p for p in private if p in (*SHARED_TMP, self.scratch)]
        self.fresh_sent = False  # the paths go once; later requests are one byte
        self.fresh_pending = False
        for fd in self.fresh or ():
            os.set_inheritable(fd, False)
        wanted = int(config.get("max_result_bytes", DEFAULT_MAX_RESULT_BYTES))
        if config.get("stage_fds"):  # created and sized by the launcher before the seccomp filter existed
            self.stage_r, self.stage_w = (int(fd) for fd in config["stage_fds"])
            for fd in (self.stage_r, self.stage_w):
                os.set_inheritable(fd, False)
        else:
            self.stage_r, self.stage_w = os.pipe()
            for size in (4 * wanted, 2 * wanted, wanted):  # slack: spliced pages may be partly filled
                try:
                    fcntl.fcntl(self.stage_w, fcntl.F_SETPIPE_SZ, size)
                    break
                except OSError:
                    continue
        self.max_result_bytes = min(wanted, fcntl.fcntl(self.stage_w, fcntl.F_GETPIPE_SZ))
        os.set_blocking(self.stage_w, False)

    # -- per-job working directory -------------------------------------------------------------------------------
    def _make_workdir(self) -> str:
        self.counter += 1
        if self.uid_block is not None:  # issue 46: the next uid of this server's own block, one per job
            first, count = self.uid_block
            self.config["uid"] = first + self.counter % count
        path = os.path.join(self.scratch, f"w{self.counter}-{os.urandom(4).hex()}")
        os.mkdir(path, 0o700)
        if self.config.get("uid") is not None:
            os.chown(path, self.config["uid"], self.config["gid"])
        return path

    def _cleanup(self, workdir: str, started: float) -> bool:
        """Remove everything the candidate could have left: processes, its directory, the shared temp dirs."""
        self._kill_everything()
        if self.fresh is not None:  # new tmpfs instances: nothing of this job's superblocks reaches the next job
            return self._request_fresh_tmpfs()  # awaited before the next fork, so it overlaps with the reply
        ok = cleanup.remove_tree(workdir)
        for path in self.wipe_dirs:
            if self._stamp(path) == self.clean_stamp.get(path):
                continue  # unchanged since it was last emptied (entries change the directory's mtime)
            ok = cleanup.wipe(path, keep=frozenset({os.path.basename(self.scratch)}) if path == "/tmp" else
                              frozenset()) and ok
            self.clean_stamp[path] = self._stamp(path)
        for path in self.sweep_dirs:  # no private tmpfs: remove what the sandbox uids created during this run
            ok = _sweep_owned(path, self.config["uid"], self.sandbox_uids) and ok
        return ok

    def _request_fresh_tmpfs(self) -> bool:
        """Ask the launcher (outside the seccomp filter) to replace every private tmpfs; `await_fresh_tmpfs` reads
        its answer. False if the request could not be sent."""
        assert self.fresh is not None
        try:
            _write_all(self.fresh[0], b"r" if self.fresh_sent else json.dumps(self.fresh_paths).encode() + b"\n")
        except OSError:
            return False
        self.fresh_sent = self.fresh_pending = True
        return True

    def await_fresh_tmpfs(self) -> bool:
        """The launcher's answer to the last request (True if none is pending); False: the tmpfs were not replaced,
        so no further job may run in this server."""
        if not self.fresh_pending or self.fresh is None:
            return True
        self.fresh_pending = False
        try:
            ready = select.select([self.fresh[1]], [], [], FRESH_TMPFS_WAIT_S)[0]
            return bool(ready) and os.read(self.fresh[1], 1) == b"1"
        except OSError:
            return False

    @staticmethod
    def _stamp(path: str) -> tuple[int, int] | None:
        """mtime and ctime of a root-owned directory: a sandbox uid cannot reset them (utime needs ownership)."""
        try:
            info = os.stat(path)
        except OSError:
            return None
        return info.st_mtime_ns, info.st_ctime_ns

    # -- fork, supervise, collect --------------------------------------------------------------------------------
    def run_job(self) -> bool:
        """Fork a child that reads one job from stdin; relay its result. Returns False when stdin is closed.

        The zygote only polls stdin (it never reads it), so no process sits idle between jobs and no job byte ever
        enters this process.
        """
        poller = select.poll()
        poller.register(0, select.POLLIN)
        events = poller.poll()[0][1]
        if not events & select.POLLIN:
            return False  # hang-up without data: the parent closed us
        workdir = self._make_workdir()
        ctl_r, ctl_w = os.pipe()
        res_r, res_w = os.pipe()
        os.set_blocking(res_r, False)
        t_fork = time.monotonic()
        pid = os.fork()
        if pid == 0:  # child: never returns into the server loop
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (ctl_r, res_r, self.stage_r, self.stage_w, self.wake_r, self.wake_w, *(self.fresh or ())):
                    os.close(fd)
                child.run_candidate(ctl_w, res_w, workdir, self.config, t_fork)
            finally:
                os._exit(child.EXIT_INTERNAL_ERROR)
        self.current_pid = pid
        os.close(ctl_w)
        os.close(res_w)
        # The job is already waiting in the pipe, so the deadline runs from the fork; the child's start report
        # stays in its control pipe until the child is gone (no extra wake-up per job).
        header = self._collect(pid, res_r, t_fork + self.timeout_s)
        started = _read_report(ctl_r)
        os.close(ctl_r)
        if started is None:  # stdin closed (shutdown) or the job frame was unreadable
            cleanup.remove_tree(workdir)
            self._kill_everything()
            return False
        header.update({"id": started.get("id"), "t_fork": t_fork, "t_child": started.get("t_child"),
                       "t_job": started["t_job"]})
        header["cleanup_ok"] = self._cleanup(workdir, t_fork)
        header["t_done"] = time.monotonic()
        self._reply(header)
        # If anything survived cleanup, exit: the parent starts a fresh namespace. A failed tmpfs replacement is
        # learnt after the reply; the next job (still in the pipe) then fails as "sandbox server exited".
        return header["cleanup_ok"] and self.await_fresh_tmpfs()

    def _collect(self, pid: int, res_r: int, deadline: float) -> dict[str, Any]:
        """Move the child's bytes into the staging pipe until it exits, overflows or runs out of time."""
        size, truncated, timed_out, status, hangup = 0, False, False, None, False
        poller = select.poll()
        poller.register(res_r, select.POLLIN)
        poller.register(0, 0)
        poller.register(self.wake_r, select.POLLIN)
        pipe_open = True
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            ready = dict(poller.poll(max(1, int(remaining * 1000 + 0.999))))
            if ready.get(0, 0) & (select.POLLHUP | select.POLLERR):
                hangup = True
                break
            if pipe_open and res_r in ready:
                moved = self._splice(res_r, size)
                if moved == -1 and ready[res_r] & select.POLLIN:
                    moved = None  # readable, yet nothing moved: the staging pipe is full
                if moved is None:
                    truncated = True
                    break
                if moved == 0:  # end of file: every writer closed it
                    pipe_open = False
                    poller.unregister(res_r)
                size += max(0, moved)
            if self.wake_r in ready:  # SIGCHLD: has our child exited?
                _drain(self.wake_r)
                done_pid, raw = os.waitpid(pid, os.WNOHANG)
                if done_pid:
                    status = raw
                    break
        t_exit = time.monotonic()
        status = self._finish(pid, None, status)
        if not truncated:
            while True:  # what the child wrote just before exiting
                moved = self._splice(res_r, size)
                if moved is None or moved <= 0:
                    truncated = moved is None
                    break
                size += moved
        os.close(res_r)
        if hangup:
            self._kill_everything()
            os._exit(0)
        return {"exit": os.waitstatus_to_exitcode(status), "timed_out": timed_out, "truncated": truncated,
                "n": size, "t_exit": t_exit}

    def _splice(self, res_r: int, size: int) -> int | None:
        """Move available bytes kernel-side into the staging pipe.

        Returns the number moved, 0 at end of file, -1 when nothing is available now, None when over the cap.
        """
        room = self.max_result_bytes - size
        try:
            if room <= 0:
                return None if os.read(res_r, 1) else 0  # one more byte means the cap is exceeded
            return os.splice(res_r, self.stage_w, room, flags=os.SPLICE_F_NONBLOCK)
        except BlockingIOError:
            return -1

    def _finish(self, pid: int, res_r: int | None, status: int | None = None) -> int:
        """SIGKILL the child's process group (and everything else in our PID namespace), reap it, close fds."""
        self._kill_group(pid)
        if status is None:
            status = os.waitpid(pid, 0)[1]
        self.current_pid = None
        if res_r is not None:
            os.close(res_r)
        return status

    def _kill_everything(self) -> None:
        """As PID 1 of our namespace, kill(-1) reaches every process but us; then reap them all (bounded)."""
        if self.pid1:
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.monotonic() + REAP_WAIT_S
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                if not self.pid1 or time.monotonic() > deadline:
                    return  # outside a PID namespace only our own children are ours to wait for
                select.select([], [], [], 0.001)  # killed processes still exiting (bounded by REAP_WAIT_S)

    @staticmethod
    def _kill_group(pid: int) -> None:
        """SIGKILL the child's whole process group (and the child itself, in case it left the group)."""
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def _reply(self, header: dict[str, Any]) -> None:
        """Header line, then the staged bytes, moved kernel-side to stdout."""
        _write_all(1, json.dumps(header).encode() + b"\n")
        left = header["n"]
        while left > 0:
            moved = os.splice(self.stage_r, 1, left)
            if moved <= 0:
                raise RuntimeError("staging pipe ran dry")
            left -= moved

    # -- start-up probe ------------------------------------------------------------------------------------------
    def probe(self) -> dict[str, Any]:
        """Run child.probe confined like a candidate and read its one-line report (small: read directly)."""
        workdir = self._make_workdir()
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(read_fd)
                for fd in self.fresh or ():
                    os.close(fd)
                child.probe(write_fd, workdir, dict(self.config, timeout_s=PROBE_TIMEOUT_S))
            finally:
                os._exit(child.EXIT_INTERNAL_ERROR)
        os.close(write_fd)
        data, deadline = b"", time.monotonic() + PROBE_TIMEOUT_S
        while time.monotonic() < deadline and b"\n" not in data:
            ready, _, _ = select.select([read_fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(read_fd, 1 << 16) if ready else b""
            if not chunk:
                break
            data += chunk
        self._finish(pid, read_fd)
        self._cleanup(workdir, 0.0)
        if not self.await_fresh_tmpfs():
            report = {"error": "the launcher could not replace the private tmpfs"}
            return report
        try:
            report = json.loads(data.decode().splitlines()[0])
        except (ValueError, IndexError):
            report = {"error": "probe failed"}
        report["pid_namespace"] = self.pid1
        return report


def _ignore(_signum: int, _frame: Any) -> None:
    """SIGCHLD handler: the wake-up pipe written by the C-level handler is what matters."""


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _read_report(ctl_r: int) -> dict[str, Any] | None:
    """The child's one-line start report ({"id", "t_child", "t_job"}), written before any candidate code ran."""
    os.set_blocking(ctl_r, False)
    try:
        data = os.read(ctl_r, 4096)
        report = json.loads(data.split(b"\n", 1)[0])
        float(report["t_job"])
        return report
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _sweep_owned(path: str, uid: int, block: range) -> bool:
    """Fallback without a private tmpfs: delete top-level entries of `path` owned by the sandbox uid(s)."""
    ok = True
    try:
        with os.scandir(path) as entries:
            owned = [e.path for e in entries if _owner(e) == uid or _owner(e) in block]
    except OSError:
        return True
    for entry in owned:
        ok = cleanup.remove_tree(entry) and ok
    return ok


def _owner(entry: os.DirEntry) -> int | None:
    try:
        return entry.stat(follow_symlinks=False).st_uid
    except OSError:
        return None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def serve(zygote: Zygote) -> None:
    """One forked child per job until stdin is closed or a cleanup failed (the parent then restarts us)."""
    while zygote.run_job():
        pass
    zygote._kill_everything()


def main() -> None:
    config = json.loads(sys.argv[1])
    os.environ.clear()  # inherited by every child: no secrets, no PATH (nothing may be executed anyway)
    preloaded = []
    for name in PRELOAD:
        try:
            __import__(name)
            preloaded.append(name)
        except ImportError:
            pass
    if config.get("audit_hook", True):
        guards.remove_functions()  # once here instead of in every child
    config["read_roots"] = list(guards.stdlib_roots())
    config["packages"] = child.packages_under(config["read_roots"])
    zygote = Zygote(config)

    def _terminate(_signum: int, _frame: Any) -> None:
        """SIGTERM from the parent: take the running candidate's process group down with us."""
        if zygote.current_pid is not None:
            Zygote._kill_group(zygote.current_pid)
        os._exit(0)

    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    gc.freeze()  # keep the collector from touching (and copy-on-write faulting) the preloaded objects in children
    hello = {"hello": 1, "pid": os.getpid(), "python": sys.version.split()[0], "probe": zygote.probe(),
             "preloaded": preloaded, "sandbox": config.get("sandbox", {}),
             "max_result_bytes": zygote.max_result_bytes}
    _write_all(1, json.dumps(hello).encode() + b"\n")
    serve(zygote)


if __name__ == "__main__":
    main()
