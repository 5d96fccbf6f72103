"""Parent side of the sandbox: start zygote processes and stream jobs through them. Runs in the trainer.

Each worker is a separate `python -I -S -B launcher.py` started with subprocess.Popen (fork+exec; the trainer
itself is never forked into a sandbox). The launcher creates the namespaces it can (mount, IPC, network, PID; plus a
user namespace when not root), mounts private noexec tmpfs and execs the zygote; the zygote's start-up probe
reports what is really enforced.

Scheduling is a single-threaded selector loop over all zygotes: up to PIPELINE_DEPTH job frames are written per
zygote. They wait in the kernel pipe, never in a process: each forked child reads exactly its own frame. Replies are
parsed as they arrive, and a zygote that dies, desyncs or stops answering (timeout + GRACE_S) is killed and
restarted, its current job reported as a sandbox failure and the rest of its queue re-sent elsewhere.

Every pool owns a host scratch directory `glm-verifier-<pid>-*` (the candidates' working directories when no
private tmpfs is available, and an `owner` file); a new pool removes the directories and kills the leftover
servers of pools whose process died without closing them (SIGKILL of the trainer).
"""

from __future__ import annotations

import atexit
import itertools
import json
import marshal
import os
import pwd
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from . import cleanup, defences, residentroot
from .judge import Reply
from .uids import BLOCK_SIZE, UidLease

LAUNCHER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher.py")
PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # glm_lightning/: tasks, sources
PIPELINE_DEPTH = 2
START_TIMEOUT_S = 60.0
GRACE_S = 1.0
STOP_WAIT_S = 2.0
SCRATCH_PREFIX = "glm-verifier-"


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


def frame(job: dict[str, Any]) -> bytes:
    """One job as the child reads it: a fixed-size length line, then the body (marshal: same interpreter, exact
    types, no Python-level decoding in the child)."""
    body = marshal.dumps(job)
    return b"%010d\n" % len(body) + body


def _start_time(pid: int) -> str | None:
    """Kernel start time of a process (field 22 of /proc/PID/stat): tells a live owner from a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def reap_stale(parent: str | None) -> int:
    """Remove scratch directories (and kill the servers) of pools whose owning process is gone. Returns a count."""
    parent = parent or tempfile.gettempdir()
    removed = 0
    try:
        names = [n for n in os.listdir(parent) if n.startswith(SCRATCH_PREFIX)]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(parent, name)
        try:
            if not _ours(path) or not _ours(os.path.join(path, "owner")):
                continue  # the parent directory is world-writable: only trust what we created ourselves
            with open(os.path.join(path, "owner")) as fh:
                fields = fh.read().split()
            owner, started, servers = int(fields[0]), fields[1], [int(x) for x in fields[2:]]
        except (OSError, ValueError, IndexError):
            continue  # not (yet) a complete pool directory: leave it
        if owner == os.getpid() or _start_time(owner) == started:
            continue  # still alive
        for server in servers:
            _kill_stale_server(server)
        if cleanup.remove_tree(path):
            removed += 1
    return removed


def _ours(path: str) -> bool:
    info = os.lstat(path)
    return info.st_uid == os.geteuid() and not info.st_mode & 0o022


def _kill_stale_server(pgid: int) -> None:
    """SIGKILL a dead pool's launcher process group, only if it still runs our launcher."""
    try:
        with open(f"/proc/{pgid}/cmdline", "rb") as fh:
            if LAUNCHER_SCRIPT.encode() not in fh.read():
                return
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


_RESIDENT: dict[int, str] = {}  # pid -> this process's resident copy (residentroot.py), shared by its pools
_RESIDENT_LOCK = threading.Lock()


def resident_root() -> str:
    """This process's private copy of the interpreter, standard library and system libraries (built on first use,
    kept for the process's lifetime: ~1 s and ~85 MB of tmpfs here). Lives in a `glm-verifier-<pid>-root-*` scratch
    directory with an owner file, so reap_stale removes it once this process is gone; removed at exit."""
    with _RESIDENT_LOCK:
        path = _RESIDENT.get(os.getpid())
        if path is not None and os.path.isdir(path):
            return os.path.join(path, "tree")
        path = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-root-", dir=scratch_parent())
        try:
            residentroot.build(os.path.join(path, "tree"))
            with open(os.path.join(path, "owner"), "w") as fh:
                fh.write(f"{os.getpid()} {_start_time(os.getpid())}\n")
        except BaseException:
            cleanup.remove_tree(path)
            raise
        if not _RESIDENT:
            atexit.register(_remove_resident)
        _RESIDENT[os.getpid()] = path
        return os.path.join(path, "tree")


def _remove_resident() -> None:
    path = _RESIDENT.pop(os.getpid(), None)
    if path is not None:
        cleanup.remove_tree(path)


class ZygoteProcess:
    """One running sandbox server (launcher + zygote): its Popen handle, raw pipe fds and start-up report."""

    def __init__(self, scratch: str, uid: int | None, gid: int | None, memory_mb: int, timeout_s: float,
                 resident: str | None = None) -> None:
        self.scratch = scratch
        self.want_namespaces = os.environ.get("GLM_VERIFIER_NO_NAMESPACES") != "1"
        off = defences.switched_off()
        # A uid block of our own (issue 46): one kernel uid per job, shared with no other server on the host.
        self.lease = UidLease() if uid is not None and "uid_pool" not in off else None
        if self.lease is not None:
            uid = self.lease.first_uid
        self.config = {"uid": uid, "gid": gid, "scratch": scratch, "memory_mb": memory_mb, "timeout_s": timeout_s,
                       "defences_off": off,
                       "resident_root": resident,
                       "uid_block": [uid, BLOCK_SIZE] if self.lease is not None else None,
                       "lease_fd": self.lease.fd if self.lease is not None else None,
                       "isolate": self.want_namespaces,
                       # Test-only switch: shows what the kernel layer contains on its own. Never set in training.
                       "audit_hook": os.environ.get("GLM_VERIFIER_UNSAFE_NO_AUDIT_HOOK") != "1",
                       # Test/benchmark-only switch: measures what the syscall allowlist costs. Never set in training.
                       "seccomp": os.environ.get("GLM_VERIFIER_UNSAFE_NO_SECCOMP") != "1",
                       "private_root": os.environ.get("GLM_VERIFIER_UNSAFE_NO_PRIVATE_ROOT") != "1",
                       # A host path the start-up probe must NOT see (this project's sources).
                       "hidden_probe": PROJECT_DIR}
        self.proc: subprocess.Popen | None = None
        self.hello: dict[str, Any] = {}
        self.start_errors: list[str] = []
        """Why the attempts before the one that started failed (e.g. with namespaces): shown by a weaker sandbox."""

    @property
    def launcher(self) -> str:
        spaces = self.hello.get("sandbox", {}).get("namespaces", {})
        names = [name for name in ("user", "mount", "ipc", "net", "pid") if spaces.get(name)]
        return "launcher.py: " + ("+".join(names) + " namespaces" if names else "no namespaces")

    @property
    def in_fd(self) -> int:
        assert self.proc is not None and self.proc.stdin is not None
        return self.proc.stdin.fileno()

    @property
    def out_fd(self) -> int:
        assert self.proc is not None and self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def start(self) -> None:
        """Start with every namespace the kernel allows; if that cannot start at all, retry without any."""
        errors = []
        for isolate in ([True, False] if self.want_namespaces else [False]):
            self.config["isolate"] = isolate
            try:
                self._start()
                self.start_errors = errors
                return
            except (OSError, RuntimeError, ValueError) as exc:
                errors.append(f"{'with' if isolate else 'without'} namespaces: {exc}")
                self.stop()
        raise RuntimeError("could not start the sandbox server: " + "; ".join(errors))

    def _start(self) -> None:
        cmd = [sys.executable, "-I", "-S", "-B", LAUNCHER_SCRIPT, json.dumps(self.config)]
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8",
               "OMP_NUM_THREADS": "1"}
        with tempfile.TemporaryFile() as stderr:  # the zygote only writes here if it crashes; kept for the message
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env,
                                         cwd="/", close_fds=True, start_new_session=True,
                                         pass_fds=() if self.lease is None else (self.lease.fd,))
            try:
                line = _read_line(self.out_fd, time.monotonic() + START_TIMEOUT_S)
                hello = json.loads(line)
                if not isinstance(hello, dict) or hello.get("hello") != 1:
                    raise ValueError(f"bad hello {line[:100]!r}")
            except (RuntimeError, ValueError) as exc:
                if self.proc.poll() is None:
                    self.proc.kill()
                self.proc.wait()
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
        """Close stdin (the zygote exits at EOF), then SIGTERM, then SIGKILL the group; always reap. Never raises."""
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
            try:
                proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=STOP_WAIT_S)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the zygote shares the launcher's process group
            except OSError:
                pass
            proc.wait(timeout=STOP_WAIT_S)
        except (OSError, subprocess.SubprocessError):
            pass

    def release(self) -> None:
        """Stop the server for good and give up our copy of its uid lease (the launcher's copy ends with it)."""
        self.stop()
        if self.lease is not None:
            self.lease.close()

    def forget(self) -> None:
        """In a forked child: drop the inherited pipe ends and lease descriptor without touching the server, which
        belongs to the parent (no wait, no signal: the child must never stop the parent's servers)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                try:
                    if stream is not None:
                        stream.close()
                except OSError:
                    pass
            proc.returncode = -1  # our copy only: keeps Popen.__del__ from waiting on a process that is not ours
        if self.lease is not None:
            self.lease.close()  # the child's copy: the lock stays held through the parent's and the launcher's


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass


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
    retire: bool = False  # the zygote announced it exits after its last reply: restart, re-queue, fail nothing


_LIVE_POOLS: weakref.WeakSet[ZygotePool] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """os.register_at_fork hook: a forked child (DDP, dataloader workers, Ray, multiprocessing) inherits every pool
    of its parent; it must never stop their servers, delete their scratch directory or write to their pipes."""
    for pool in list(_LIVE_POOLS):
        pool.forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class VerifierClosedError(RuntimeError):
    """The Verifier was closed (possibly by another thread while this batch ran)."""


class ForeignProcessError(RuntimeError):
    """A pool was used from a process that did not create it (a forked child)."""


class ZygotePool:
    """`workers` sandbox servers sharing one private host scratch directory.

    Safe under threads, close() and fork (issue 46): `run` is serialised by a lock; `close` cancels a running batch
    (which then raises VerifierClosedError), waits for it to stop and only then stops the servers, so no server is
    restarted after close; a forked child forgets the inherited pool (its own copies of the pipe ends and uid leases
    are closed, the parent's servers and scratch directory are untouched) and gets ForeignProcessError if it calls
    `run`."""

    def __init__(self, workers: int, memory_mb: int, timeout_s: float = 2.0) -> None:
        self.owner_pid = os.getpid()
        self.forked = False
        self._lock = threading.RLock()
        self._wake_r, self._wake_w = os.pipe()  # close() wakes a running batch's selector through this
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self.closed = False
        self.zygotes: list[ZygoteProcess] = []
        _LIVE_POOLS.add(self)
        self.uid, self.gid = unprivileged_ids()
        self.reaped = reap_stale(scratch_parent())
        self.scratch = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=scratch_parent())
        os.chmod(self.scratch, 0o711)  # the unprivileged child must traverse it, never list or write it
        self.memory_mb = memory_mb
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        try:
            resident = None
            if "resident_root" not in defences.switched_off() and os.geteuid() == 0 and \
                    os.environ.get("GLM_VERIFIER_NO_NAMESPACES") != "1" and \
                    os.environ.get("GLM_VERIFIER_UNSAFE_NO_PRIVATE_ROOT") != "1":
                resident = resident_root()
            for _ in range(workers):
                zygote = ZygoteProcess(self.scratch, self.uid, self.gid, memory_mb, timeout_s, resident)
                try:
                    zygote.start()
                except BaseException:
                    zygote.release()
                    raise
                self.zygotes.append(zygote)
                self._write_owner()
        except BaseException:
            self.close()
            raise

    def _write_owner(self) -> None:
        """`<pid> <start time> <server process groups...>`, replaced atomically; read by reap_stale."""
        servers = " ".join(str(z.proc.pid) for z in self.zygotes if z.proc is not None)
        tmp = os.path.join(self.scratch, ".owner")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
            fh.write(f"{os.getpid()} {_start_time(os.getpid())} {servers}\n")
        os.replace(tmp, os.path.join(self.scratch, "owner"))

    def _restart(self, zygote: ZygoteProcess) -> None:
        zygote.stop()
        if self.closed:  # never start a server after close(): it would outlive the Verifier
            raise VerifierClosedError("the verifier was closed while this batch ran")
        zygote.start()
        try:
            self._write_owner()
        except OSError:
            pass

    def next_id(self) -> int:
        return next(self._ids)  # atomic under the GIL: callers need not hold the lock

    def close(self) -> None:
        """Cancel a running batch, wait for it, stop every server, remove the scratch directory. Idempotent; never
        raises. In a forked child it only forgets the parent's pool."""
        if os.getpid() != self.owner_pid:
            self.forget_after_fork()
            return
        if self.closed and self._wake_w < 0:
            return  # already closed
        self.closed = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        # A batch in another thread sees the wake-up at once and stops; the bound only guards against a thread
        # that can no longer run (e.g. a daemon thread at interpreter exit).
        locked = self._lock.acquire(timeout=self.timeout_s + GRACE_S + 2 * STOP_WAIT_S)
        try:
            for zygote in self.zygotes:
                try:
                    zygote.release()
                except Exception:  # noqa: BLE001 - close must not raise
                    pass
            try:
                cleanup.remove_tree(self.scratch)
            except Exception:  # noqa: BLE001
                pass
            if locked:  # no batch can be selecting on the wake-up pipe any more
                for fd in (self._wake_r, self._wake_w):
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                self._wake_r = self._wake_w = -1
        finally:
            if locked:
                self._lock.release()

    def forget_after_fork(self) -> None:
        """In a forked child: close our copies of the parent's pipes and leases; never signal or wait."""
        if self.forked or os.getpid() == self.owner_pid:
            return
        self.forked = True
        self._lock = threading.RLock()  # another thread of the parent may have held it at fork time
        for zygote in self.zygotes:
            zygote.forget()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _check_owner(self) -> None:
        if os.getpid() != self.owner_pid:
            raise ForeignProcessError(
                f"this Verifier belongs to process {self.owner_pid}; process {os.getpid()} is a fork of it "
                "(DDP, dataloader or Ray workers, multiprocessing): create a Verifier in the child instead. Its "
                "servers and pipes stay the parent's, so the child's copy is never used (frames would interleave).")

    def run(self, jobs: list[dict[str, Any]], timeout_s: float) -> list[Reply]:
        """Run every job, in parallel across zygotes; replies in job order."""
        self._check_owner()
        with self._lock:
            if self.closed:
                raise VerifierClosedError("the verifier is closed")
            try:
                for zygote in self.zygotes:
                    if zygote.proc is None or zygote.proc.poll() is not None:
                        self._restart(zygote)
                return self._run(jobs, timeout_s)
            except BaseException as exc:
                # Interrupted (e.g. KeyboardInterrupt), closed, or a restart failed: zygotes may still hold queued
                # work whose replies would be mistaken for the next run's, so replace them all before anyone
                # reuses us.
                for zygote in self.zygotes:
                    zygote.stop()
                if self.closed and isinstance(exc, Exception) and not isinstance(exc, VerifierClosedError):
                    raise VerifierClosedError("the verifier was closed while this batch ran") from exc
                raise

    def _run(self, jobs: list[dict[str, Any]], timeout_s: float) -> list[Reply]:
        results: list[Reply | None] = [None] * len(jobs)
        sent_at = [0.0] * len(jobs)
        lines = [frame(job) for job in jobs]
        pending = deque(range(len(jobs)))
        lanes = [_Lane(z) for z in self.zygotes]
        budget = timeout_s + GRACE_S
        sel = selectors.DefaultSelector()
        try:
            sel.register(self._wake_r, selectors.EVENT_READ, None)
            for lane in lanes:
                sel.register(lane.zygote.out_fd, selectors.EVENT_READ, lane)
            while pending or any(lane.inflight for lane in lanes):
                if self.closed:
                    raise VerifierClosedError("the verifier was closed while this batch ran")
                now = time.monotonic()
                for lane in lanes:
                    while pending and len(lane.inflight) < PIPELINE_DEPTH and not lane.retire:
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
                    if lane is None:  # close() from another thread (checked at the top of the loop)
                        _drain(self._wake_r)
                        continue
                    if mask & selectors.EVENT_WRITE:
                        self._flush(lane)
                        self._want_write(sel, lane)
                    if mask & selectors.EVENT_READ and key.fd == lane.zygote.out_fd:
                        self._receive(lane, jobs, results, sent_at)
                now = time.monotonic()
                for lane in lanes:
                    if lane.failed is None and lane.inflight and now > lane.head_started + budget:
                        lane.failed = "sandbox server stopped responding"
                    if lane.failed is not None or (lane.retire and not lane.inbuf):
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
                if header.get("cleanup_ok") is False:
                    lane.retire = True
                    return
            lane.head_started = now

    def _recover(self, sel: selectors.BaseSelector, lane: _Lane, pending: deque, results: list,
                 sent_at: list[float]) -> None:
        """Kill and restart a broken zygote; its current job fails, the rest of its queue is retried."""
        reason = lane.failed
        if lane.inflight and reason is not None and not lane.retire:
            index = lane.inflight.popleft()
            results[index] = Reply(None, b"", reason, sent_at[index], time.monotonic())
        pending.extendleft(reversed(lane.inflight))
        for fd in (lane.zygote.out_fd, lane.zygote.in_fd):
            try:
                sel.unregister(fd)
            except (KeyError, ValueError):
                pass
        self._restart(lane.zygote)
        lane.inflight.clear()
        lane.retire = False
        lane.outbuf.clear()
        lane.inbuf.clear()
        lane.writing = False
        lane.failed = None
        sel.register(lane.zygote.out_fd, selectors.EVENT_READ, lane)
