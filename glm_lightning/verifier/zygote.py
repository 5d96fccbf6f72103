"""The sandbox server ("zygote"): a clean, single-threaded interpreter that forks one child per candidate.

Why: forking the (multithreaded) trainer can deadlock and would copy its memory, secrets and open files into the
child, while a fresh interpreter per candidate costs tens of ms of CPU. So the parent starts this script once per worker
with `subprocess.Popen([python, "-I", "-S", "-B", zygote.py, CONFIG])` (fork+exec, optionally wrapped in
`unshare --net --pid --fork --kill-child`), and this process forks a confined child per job.

Protocol on stdin/stdout (the child never keeps these: it points 0/1/2 at /dev/null):
    parent -> zygote: one JSON object per line: {"id", "source", "entry_point", "inputs", "nonce", "timeout_s",
                      "memory_mb"}; EOF means shut down.
    zygote -> parent: first a hello line {"hello": 1, "probe": {...}, ...}; then per job one JSON header line
                      {"id", "exit", "timed_out", "truncated", "n", "t_fork", "t_exit", "t_done"} followed by
                      exactly n raw bytes: what the child wrote to its private result pipe (capped).
The zygote only relays bytes and enforces the wall-clock limit; the trusted parent interprets them (judge.py).

Stdlib only. Runs as a script, so it imports its siblings as top-level modules and then removes its own directory
from sys.path again.
"""

from __future__ import annotations

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
import guards  # noqa: E402

sys.path.remove(HERE)

# Imported once here so that candidates importing them pay nothing after fork. Kept small on purpose: every
# preloaded module makes each fork (page tables) and each child (copy-on-write faults) more expensive, and e.g.
# `random` drags in OpenSSL. Anything else is still importable on demand from the standard library.
PRELOAD = ("math", "re", "itertools", "functools", "collections", "string", "heapq", "bisect", "operator", "copy",
           "typing")
DEFAULT_MAX_RESULT_BYTES = 1 << 20
PROBE_TIMEOUT_S = 5.0


class Zygote:
    """Fork-per-job server state: configuration, scratch directory and a job counter."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.scratch = config["scratch"]
        self.max_result_bytes = int(config.get("max_result_bytes", DEFAULT_MAX_RESULT_BYTES))
        self.counter = 0
        self.has_pidfd = hasattr(os, "pidfd_open")
        self.current_pid: int | None = None

    # -- per-job working directory -------------------------------------------------------------------------------
    def _make_workdir(self) -> str:
        self.counter += 1
        path = os.path.join(self.scratch, f"w{self.counter}-{os.urandom(4).hex()}")
        os.mkdir(path, 0o700)
        if self.config.get("uid") is not None:
            os.chown(path, self.config["uid"], self.config["gid"])
        return path

    @staticmethod
    def _remove_workdir(path: str) -> None:
        """Delete the candidate's directory tree (without shutil: it would drag zlib/bz2/lzma into every fork)."""
        try:
            os.rmdir(path)
            return
        except OSError:
            pass
        for root, dirs, _files in os.walk(path):  # the candidate may have made its directories unreadable
            for name in dirs:
                full = os.path.join(root, name)
                try:
                    if not os.path.islink(full):
                        os.chmod(full, 0o700)
                except OSError:
                    pass
        for root, dirs, files in os.walk(path, topdown=False):
            for name in files + dirs:
                full = os.path.join(root, name)
                try:
                    if name in dirs and not os.path.islink(full):
                        os.rmdir(full)
                    else:
                        os.unlink(full)
                except OSError:
                    pass
        try:
            os.rmdir(path)
        except OSError:
            pass

    # -- fork, supervise, collect --------------------------------------------------------------------------------
    def spawn(self, target: Callable, job: dict[str, Any], timeout_s: float) -> tuple[dict[str, Any], bytes]:
        """Fork `target(job, result_fd, workdir, config)` and collect its result bytes within `timeout_s`."""
        config = dict(self.config, timeout_s=job.get("timeout_s", timeout_s),
                      memory_mb=job.get("memory_mb", self.config.get("memory_mb", 256)))
        workdir = self._make_workdir()
        read_fd, write_fd = os.pipe()
        t_fork = time.monotonic()
        pid = os.fork()
        if pid == 0:  # child: never returns into the server loop
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.close(read_fd)
                target(job, write_fd, workdir, config)
            finally:
                os._exit(child.EXIT_INTERNAL_ERROR)
        self.current_pid = pid
        os.close(write_fd)
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass  # the child already called setsid()
        pidfd = None
        if self.has_pidfd:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                pidfd = None
        chunks: list[bytes] = []
        size, truncated, timed_out, status = 0, False, False, None
        deadline = t_fork + timeout_s
        pipe_open = True
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            watch = ([read_fd] if pipe_open else []) + ([pidfd] if pidfd is not None else [])
            ready, _, _ = select.select(watch, [], [], remaining if pidfd is not None else min(remaining, 0.002))
            if read_fd in ready:
                data = os.read(read_fd, 1 << 16)
                if not data:
                    pipe_open = False
                else:
                    size += len(data)
                    if size > self.max_result_bytes:
                        truncated = True
                        break
                    chunks.append(data)
            if pidfd is not None and pidfd in ready:
                break
            if pidfd is None:
                done_pid, raw = os.waitpid(pid, os.WNOHANG)
                if done_pid:
                    status = raw
                    break
        t_exit = time.monotonic()
        self._kill_group(pid)
        if status is None:
            status = os.waitpid(pid, 0)[1]
        self.current_pid = None
        if not truncated:
            size = self._drain(read_fd, chunks, size)
            truncated = size > self.max_result_bytes
        os.close(read_fd)
        if pidfd is not None:
            os.close(pidfd)
        self._remove_workdir(workdir)
        self._reap_orphans()
        payload = b"".join(chunks)[: self.max_result_bytes]
        header = {"id": job.get("id"), "exit": os.waitstatus_to_exitcode(status), "timed_out": timed_out,
                  "truncated": truncated, "n": len(payload), "t_fork": t_fork, "t_exit": t_exit,
                  "t_done": time.monotonic()}
        return header, payload

    @staticmethod
    def _kill_group(pid: int) -> None:
        """SIGKILL the child's whole process group (and the child itself, in case it left the group)."""
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def _drain(self, fd: int, chunks: list[bytes], size: int) -> int:
        """Read what is left in the pipe without blocking (a writer that escaped the kill must not hang us)."""
        os.set_blocking(fd, False)
        while size <= self.max_result_bytes:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                break
            if not data:
                break
            size += len(data)
            chunks.append(data)
        return size

    @staticmethod
    def _reap_orphans() -> None:
        """As PID 1 of a PID namespace we inherit every orphan; reap them so none stays a zombie."""
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    # -- start-up probe ------------------------------------------------------------------------------------------
    def probe(self) -> dict[str, Any]:
        header, payload = self.spawn(child.probe, {"id": "probe", "timeout_s": PROBE_TIMEOUT_S}, PROBE_TIMEOUT_S)
        try:
            report = json.loads(payload.decode().splitlines()[0])
        except (ValueError, IndexError):
            report = {"error": f"probe failed (exit {header['exit']}, timed out {header['timed_out']})"}
        report["pid_namespace"] = os.getpid() == 1
        report["pidfd"] = self.has_pidfd
        return report


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _reply(header: dict[str, Any], payload: bytes = b"") -> None:
    _write_all(1, json.dumps(header).encode() + b"\n" + payload)


def serve(zygote: Zygote) -> None:
    """Read jobs from stdin until EOF; one job at a time (the parent pipelines and runs several zygotes)."""
    buffer = b""
    while True:
        data = os.read(0, 1 << 16)
        if not data:
            return
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            try:
                job = json.loads(line)
                timeout_s = float(job["timeout_s"])
            except (ValueError, KeyError, TypeError) as exc:
                _reply({"id": None, "bad_request": f"{type(exc).__name__}: {exc}"[:200], "n": 0})
                continue
            header, payload = zygote.spawn(child.run_candidate, job, timeout_s)
            _reply(header, payload)


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
    config["read_roots"] = list(guards.stdlib_roots())
    config["packages"] = child.packages_under(config["read_roots"])
    zygote = Zygote(config)

    def _terminate(_signum: int, _frame: Any) -> None:
        """SIGTERM from the parent: take the running candidate's process group down with us."""
        if zygote.current_pid is not None:
            Zygote._kill_group(zygote.current_pid)
        os._exit(0)

    signal.signal(signal.SIGTERM, _terminate)
    gc.freeze()  # keep the collector from touching (and copy-on-write faulting) the preloaded objects in children
    hello = {"hello": 1, "pid": os.getpid(), "python": sys.version.split()[0], "probe": zygote.probe(),
             "preloaded": preloaded}
    _reply(hello)
    serve(zygote)


if __name__ == "__main__":
    main()
