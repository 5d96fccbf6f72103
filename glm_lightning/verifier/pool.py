"""Parent side of the sandbox: start zygote processes and stream jobs through them. Runs in the trainer.

Each zygote is a separate `python -I -S -B zygote.py` started with subprocess.Popen (fork+exec; the trainer itself
is never forked into a sandbox). Where the kernel allows it the zygote is wrapped in
`unshare --net --pid --fork --kill-child`: candidates then have no network at all, live in a PID namespace whose
init is the zygote, and everything dies with the launcher. The launcher is chosen once per process by trying the
strongest variant first; the zygote's start-up probe reports what is really enforced.

Scheduling is a single-threaded selector loop over all zygotes: up to PIPELINE_DEPTH jobs are queued per zygote
(so it never idles waiting for the parent), replies are parsed as they arrive, and a zygote that dies, desyncs or
stops answering (timeout + grace) is killed and restarted, its current job reported as a sandbox failure and the
rest of its queue re-sent elsewhere.
"""

from __future__ import annotations

import itertools
import json
import os
import pwd
import selectors
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .judge import Reply

ZYGOTE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")
PIPELINE_DEPTH = 2
START_TIMEOUT_S = 60.0
GRACE_S = 3.0
STOP_WAIT_S = 2.0

_LAUNCHER_LOCK = threading.Lock()
_LAUNCHER_CACHE: dict[bool, int] = {}


def unprivileged_ids() -> tuple[int | None, int | None]:
    """(uid, gid) to drop to in the child: nobody/nogroup when we are root, None when already unprivileged."""
    if os.geteuid() != 0:
        return None, None
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def scratch_parent() -> str | None:
    """Prefer tmpfs: creating and removing a directory per candidate costs ~3 ms on ext4 (journal), ~30 us here."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return None


def launcher_candidates(as_root: bool) -> list[tuple[str, list[str]]]:
    """Wrappers to try, strongest first. Non-root needs a user namespace to create the others."""
    unshare = shutil.which("unshare") or "/usr/bin/unshare"
    user = [] if as_root else ["--user", "--map-root-user"]
    options = []
    if os.path.exists(unshare):
        options.append(("unshare " + " ".join(user + ["--net", "--pid", "--fork", "--kill-child"]),
                        [unshare, *user, "--net", "--pid", "--fork", "--kill-child"]))
        options.append(("unshare " + " ".join(user + ["--net"]), [unshare, *user, "--net"]))
    options.append(("none", []))
    return options


class ZygoteProcess:
    """One running zygote: its Popen handle, raw pipe fds and start-up report."""

    def __init__(self, scratch: str, uid: int | None, gid: int | None, memory_mb: int) -> None:
        self.scratch = scratch
        self.config = {"uid": uid, "gid": gid, "scratch": scratch, "memory_mb": memory_mb}
        self.proc: subprocess.Popen | None = None
        self.hello: dict[str, Any] = {}
        self.launcher = "none"

    @property
    def in_fd(self) -> int:
        assert self.proc is not None and self.proc.stdin is not None
        return self.proc.stdin.fileno()

    @property
    def out_fd(self) -> int:
        assert self.proc is not None and self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def start(self) -> None:
        """Start with the strongest launcher that works here (remembered for the rest of the process)."""
        as_root = os.geteuid() == 0
        options = launcher_candidates(as_root)
        first = _LAUNCHER_CACHE.get(as_root, 0)
        errors = []
        for index in range(first, len(options)):
            name, prefix = options[index]
            try:
                self._start_with(prefix)
            except (OSError, RuntimeError) as exc:
                errors.append(f"{name}: {exc}")
                self.stop()
                continue
            with _LAUNCHER_LOCK:
                _LAUNCHER_CACHE[as_root] = index
            self.launcher = name
            return
        raise RuntimeError("could not start the sandbox server: " + "; ".join(errors))

    def _start_with(self, prefix: list[str]) -> None:
        cmd = [*prefix, sys.executable, "-I", "-S", "-B", ZYGOTE_SCRIPT, json.dumps(self.config)]
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8",
               "OMP_NUM_THREADS": "1"}
        with tempfile.TemporaryFile() as stderr:  # the zygote only writes here if it crashes; kept for the message
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env,
                                         cwd=self.scratch, close_fds=True, start_new_session=True)
            try:
                line = _read_line(self.out_fd, time.monotonic() + START_TIMEOUT_S)
                hello = json.loads(line)
                if not isinstance(hello, dict) or hello.get("hello") != 1:
                    raise ValueError(f"bad hello {line[:100]!r}")
            except (RuntimeError, ValueError) as exc:
                time.sleep(0.05)
                stderr.seek(0)
                tail = stderr.read()[-300:].decode(errors="replace").strip()
                raise RuntimeError(f"{exc}{': ' + tail if tail else ''}") from None
        probe = hello.get("probe", {})
        if "error" in probe:
            raise RuntimeError(f"sandbox self-test failed: {probe['error']}")
        self.hello = hello
        os.set_blocking(self.in_fd, False)
        os.set_blocking(self.out_fd, False)

    def stop(self) -> None:
        """Close stdin (the zygote exits at EOF), then SIGTERM, then SIGKILL; always reap."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _read_line(fd: int, deadline: float) -> bytes:
    """Blocking-with-deadline read of one line from a pipe (used only for the hello)."""
    buffer = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError("sandbox server did not start in time")
            if not sel.select(remaining):
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError("sandbox server exited during start-up")
            buffer += chunk
    line, _, rest = buffer.partition(b"\n")
    if rest:
        raise RuntimeError("unexpected data after hello")
    return line


@dataclass
class _Lane:
    """Per-zygote scheduling state during one `run`."""

    zygote: ZygoteProcess
    inflight: deque = field(default_factory=deque)
    outbuf: bytearray = field(default_factory=bytearray)
    inbuf: bytearray = field(default_factory=bytearray)
    head_started: float = 0.0
    writing: bool = False
    failed: str | None = None


class ZygotePool:
    """`workers` zygotes sharing one private scratch directory; `run` is thread-safe (serialised)."""

    def __init__(self, workers: int, memory_mb: int) -> None:
        self.uid, self.gid = unprivileged_ids()
        self.scratch = tempfile.mkdtemp(prefix="glm-verifier-", dir=scratch_parent())
        os.chmod(self.scratch, 0o711)  # the unprivileged child must traverse it, never list or write it
        self.memory_mb = memory_mb
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.zygotes: list[ZygoteProcess] = []
        self.closed = False
        try:
            for _ in range(workers):
                zygote = ZygoteProcess(self.scratch, self.uid, self.gid, memory_mb)
                zygote.start()
                self.zygotes.append(zygote)
        except BaseException:
            self.close()
            raise

    def next_id(self) -> int:
        return next(self._ids)  # atomic under the GIL: callers need not hold the lock

    def close(self) -> None:
        self.closed = True
        for zygote in self.zygotes:
            zygote.stop()
        shutil.rmtree(self.scratch, ignore_errors=True)

    def run(self, jobs: list[dict[str, Any]], timeout_s: float) -> list[Reply]:
        """Run every job, in parallel across zygotes; replies in job order."""
        with self._lock:
            if self.closed:
                raise RuntimeError("the verifier is closed")
            for zygote in self.zygotes:
                if zygote.proc is None or zygote.proc.poll() is not None:
                    zygote.stop()
                    zygote.start()
            try:
                return self._run(jobs, timeout_s)
            except BaseException:
                # Interrupted (e.g. KeyboardInterrupt) or a restart failed: zygotes may still hold queued work
                # whose replies would be mistaken for the next run's, so replace them all before anyone reuses us.
                for zygote in self.zygotes:
                    zygote.stop()
                raise

    def _run(self, jobs: list[dict[str, Any]], timeout_s: float) -> list[Reply]:
        results: list[Reply | None] = [None] * len(jobs)
        sent_at = [0.0] * len(jobs)
        lines = [(json.dumps(job) + "\n").encode() for job in jobs]
        pending = deque(range(len(jobs)))
        lanes = [_Lane(z) for z in self.zygotes]
        budget = timeout_s + GRACE_S
        sel = selectors.DefaultSelector()
        try:
            for lane in lanes:
                sel.register(lane.zygote.out_fd, selectors.EVENT_READ, lane)
            while pending or any(lane.inflight for lane in lanes):
                now = time.monotonic()
                for lane in lanes:
                    while pending and len(lane.inflight) < PIPELINE_DEPTH:
                        index = pending.popleft()
                        if not lane.inflight:
                            lane.head_started = now
                        lane.inflight.append(index)
                        lane.outbuf += lines[index]
                        sent_at[index] = now
                    self._flush(lane)
                    self._want_write(sel, lane)
                waits = [lane.head_started + budget - now for lane in lanes if lane.inflight]
                for key, mask in sel.select(max(0.0, min(waits + [1.0]))):
                    lane = key.data
                    if mask & selectors.EVENT_WRITE:
                        self._flush(lane)
                        self._want_write(sel, lane)
                    if mask & selectors.EVENT_READ and key.fd == lane.zygote.out_fd:
                        self._receive(lane, jobs, results, sent_at)
                now = time.monotonic()
                for lane in lanes:
                    if lane.failed is None and lane.inflight and now > lane.head_started + budget:
                        lane.failed = "sandbox server stopped responding"
                    if lane.failed is not None:
                        self._recover(sel, lane, pending, results, sent_at)
        finally:
            sel.close()
        return [r if r is not None else Reply(None, b"", "lost") for r in results]

    @staticmethod
    def _flush(lane: _Lane) -> None:
        if not lane.outbuf or lane.failed:
            return
        try:
            written = os.write(lane.zygote.in_fd, lane.outbuf)
        except BlockingIOError:
            return
        except OSError as exc:
            lane.failed = f"sandbox server pipe broken ({exc.strerror})"
            return
        del lane.outbuf[:written]

    @staticmethod
    def _want_write(sel: selectors.BaseSelector, lane: _Lane) -> None:
        want = bool(lane.outbuf) and lane.failed is None
        if want and not lane.writing:
            sel.register(lane.zygote.in_fd, selectors.EVENT_WRITE, lane)
        elif lane.writing and not want:
            sel.unregister(lane.zygote.in_fd)
        lane.writing = want

    def _receive(self, lane: _Lane, jobs: list[dict[str, Any]], results: list, sent_at: list[float]) -> None:
        try:
            chunk = os.read(lane.zygote.out_fd, 1 << 20)
        except BlockingIOError:
            return
        except OSError as exc:
            lane.failed = f"sandbox server pipe broken ({exc.strerror})"
            return
        if not chunk:
            lane.failed = "sandbox server exited"
            return
        lane.inbuf += chunk
        while lane.inflight:
            newline = lane.inbuf.find(b"\n")
            if newline < 0:
                return
            try:
                header = json.loads(lane.inbuf[:newline])
                size = int(header.get("n", 0))
            except (ValueError, TypeError, AttributeError):
                lane.failed = "sandbox server sent a malformed header"
                return
            if len(lane.inbuf) < newline + 1 + size:
                return
            payload = bytes(lane.inbuf[newline + 1: newline + 1 + size])
            del lane.inbuf[: newline + 1 + size]
            index = lane.inflight.popleft()
            now = time.monotonic()
            if "bad_request" in header:
                results[index] = Reply(header, b"", f"rejected job: {header['bad_request']}", sent_at[index], now)
            elif header.get("id") != jobs[index]["id"]:
                lane.failed = "sandbox server replied out of order"
                lane.inflight.appendleft(index)
                return
            else:
                results[index] = Reply(header, payload, None, sent_at[index], now)
            lane.head_started = now

    def _recover(self, sel: selectors.BaseSelector, lane: _Lane, pending: deque, results: list,
                 sent_at: list[float]) -> None:
        """Kill and restart a broken zygote; its current job fails, the rest of its queue is retried."""
        reason = lane.failed
        if lane.inflight:
            index = lane.inflight.popleft()
            results[index] = Reply(None, b"", reason, sent_at[index], time.monotonic())
        pending.extendleft(reversed(lane.inflight))
        for fd in (lane.zygote.out_fd, lane.zygote.in_fd):
            try:
                sel.unregister(fd)
            except (KeyError, ValueError):
                pass
        lane.zygote.stop()
        lane.zygote.start()
        lane.inflight.clear()
        lane.outbuf.clear()
        lane.inbuf.clear()
        lane.writing = False
        lane.failed = None
        sel.register(lane.zygote.out_fd, selectors.EVENT_READ, lane)
