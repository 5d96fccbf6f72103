"""Public entry point: validate the caller's input, run candidates through the zygote pool, judge the replies."""

from __future__ import annotations

import keyword
import logging
import math
import os
import secrets
import weakref
from collections.abc import Sequence
from typing import Any

from . import child, defences, protocol
from .judge import judge
from .pool import VerifierClosedError, ZygotePool
from .verdict import Verdict

MAX_SOURCE_CHARS = 200_000
MAX_TESTS = 1_000
MIN_MEMORY_MB = 64
ALLOW_WEAKER_ENV = "GLM_VERIFIER_ALLOW_WEAKER_SANDBOX"
UNSAFE_TEST_SWITCHES = ("GLM_VERIFIER_UNSAFE_NO_AUDIT_HOOK", "GLM_VERIFIER_UNSAFE_NO_SECCOMP",
                        "GLM_VERIFIER_UNSAFE_NO_PRIVATE_ROOT")
# The protections docs/verifier.md promises (keys of `protections`); any of them missing makes the sandbox weaker.
PROMISED = ("mount_namespace", "private_root", "host_sources_hidden", "private_tmpfs", "pid_namespace",
            "private_proc", "ipc_namespace", "sysv_ipc_disabled", "network_namespace", "seccomp", "locks_refused",
            "unprivileged_uid", "nproc_enforced", "memfd_noexec", "audit_hook", "proc_view", "passwd_entry",
            "resident_root")
PRIVATE_TMPFS = ("/tmp", "/var/tmp", "/dev/shm", "/tmp/.glm-work")
log = logging.getLogger("glm_lightning.verifier")


class WeakerSandboxError(RuntimeError):
    """A protection the docs promise is not active here and the caller did not opt in to a weaker sandbox."""

Test = tuple[tuple, Any]


class Verifier:
    """Runs untrusted Python functions against hidden tests in sandboxed child processes.

        with Verifier(timeout_s=2.0, memory_mb=256, workers=2) as v:
            v.check("def inc(x):\\n    return x + 1\\n", "inc", [((1,), 2), ((5,), 6)]).status   # "passed"

    `workers` zygote servers are started immediately (each a clean `python -I -S` process that forks one confined
    child per candidate); `protections` reports what the start-up probe found enforced on this machine.
    `timeout_s` bounds each candidate's whole run (module body plus every test), wall clock, enforced by the
    zygote with a process-group SIGKILL; RLIMIT_CPU is a second bound.
    """

    def __init__(self, timeout_s: float = 2.0, memory_mb: int = 256, workers: int = 2,
                 allow_weaker_sandbox: bool = False) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
                or not 0 < timeout_s <= 600:
            raise ValueError(f"timeout_s must be a number in (0, 600], got {timeout_s!r}")
        if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or not MIN_MEMORY_MB <= memory_mb <= 1 << 20:
            raise ValueError(f"memory_mb must be an int >= {MIN_MEMORY_MB}, got {memory_mb!r}")
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= 64:
            raise ValueError(f"workers must be an int in [1, 64], got {workers!r}")
        self.timeout_s = float(timeout_s)
        self.memory_mb = memory_mb
        self.workers = workers
        self._pool = ZygotePool(workers, memory_mb, self.timeout_s)
        self._finalizer = weakref.finalize(self, self._pool.close)  # also runs at interpreter exit
        self.missing = self.missing_protections()
        if self.missing:
            what = self.summary()
            opted_in = allow_weaker_sandbox or os.environ.get(ALLOW_WEAKER_ENV) == "1" or \
                any(os.environ.get(name) == "1" for name in UNSAFE_TEST_SWITCHES) or bool(defences.switched_off())
            if not opted_in:
                self.close()
                raise WeakerSandboxError(f"{what}; refusing to run untrusted code (opt in with "
                                         f"allow_weaker_sandbox=True or {ALLOW_WEAKER_ENV}=1)")
            log.warning(what)
        self.stats: dict[str, float] = {"candidates": 0, "fork_s": 0.0, "setup_s": 0.0, "run_s": 0.0,
                                        "cleanup_s": 0.0, "round_trip_s": 0.0}

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every zygote (and with it any running candidate) and remove the scratch directory.

        Idempotent and never raises."""
        try:
            self._finalizer()
        except Exception:  # noqa: BLE001 - closing must never take the trainer down
            pass

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def owner_pid(self) -> int:
        """The process that created this Verifier and owns its servers; a forked child (os.getpid() differs) must
        build its own (using this one raises ForeignProcessError)."""
        return self._pool.owner_pid

    def __getstate__(self) -> None:
        raise TypeError("a Verifier cannot be pickled (it owns sandbox servers of this process); create one in "
                        "each worker process instead")

    def __enter__(self) -> Verifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- reporting -----------------------------------------------------------------------------------------------
    @property
    def protections(self) -> dict[str, Any]:
        """What isolates candidates here, as detected at start-up (see docs/verifier.md, "Fallback")."""
        zygote = self._pool.zygotes[0]
        probe = zygote.hello.get("probe", {})
        sandbox = zygote.hello.get("sandbox", {})
        spaces = sandbox.get("namespaces", {})
        private = sandbox.get("private_tmpfs", [])
        noexec = probe.get("noexec", [])
        return {
            "process_model": "launcher.py (namespaces) -> zygote per worker; one forked child per job, which reads "
                             "its own job from the pipe (the zygote never holds job or result bytes)",
            "launcher": zygote.launcher,
            "private_root": bool(sandbox.get("private_root")),
            "visible_root": probe.get("root_entries"),
            "host_sources_hidden": bool(probe.get("host_sources_hidden")),
            "seccomp": probe.get("seccomp_mode") == "2" and bool(sandbox.get("seccomp")),
            "seccomp_allowlist": sandbox.get("seccomp"),
            "no_new_privs": probe.get("no_new_privs") == "1",
            "locks_refused": bool(probe.get("locks_refused")),
            "user_namespace": bool(spaces.get("user")),
            "mount_namespace": bool(spaces.get("mount")),
            "private_tmpfs": [p for p in private if p in noexec or p == "/tmp/.glm-work"],
            "tmpfs_noexec": sorted(noexec),
            "readonly_remounts": sandbox.get("readonly_remounts", 0),
            "ipc_namespace": bool(spaces.get("ipc")),
            "sysv_ipc_disabled": bool(probe.get("sysv_ipc_disabled")),
            "network_namespace": probe.get("interfaces") == ["lo"] and probe.get("loopback") != "connected",
            "loopback_probe": probe.get("loopback"),
            "pid_namespace": bool(probe.get("pid_namespace")),
            "private_proc": bool(sandbox.get("private_proc")) and probe.get("visible_processes", 99) <= 2,
            "memfd_noexec": probe.get("memfd_noexec") == "2",
            "kill_on_parent_exit": True,
            "unprivileged_uid": probe.get("uid") if probe.get("uid") not in (None, 0) else None,
            # issue 46: a kernel uid per job from a block leased for this server alone (None: all jobs share one)
            "per_job_uid": zygote.config.get("uid_block"),
            "passwd_entry": probe.get("passwd_name"),
            "proc_view": bool(sandbox.get("proc_view")) and probe.get("meminfo_total_kb") == self.memory_mb * 1024,
            "defences_off": list(zygote.config.get("defences_off", [])),
            "resident_root": bool(sandbox.get("resident_root")),
            "nproc_enforced": bool(probe.get("fork_blocked")),
            "outside_write_blocked": bool(probe.get("outside_write_blocked")),
            "audit_hook": bool(zygote.config.get("audit_hook", True)),
            "violations_fatal": True,
            "rlimits": {"cpu_s": int(self.timeout_s) + 2, "address_space_mb": self.memory_mb,
                        "file_size_bytes": child.FILE_SIZE_LIMIT, "open_files": child.OPEN_FILES_LIMIT,
                        "processes": 0, "core_bytes": 0, "queued_signals": 0},
            "wall_clock_timeout_s": self.timeout_s,
            "process_group_kill": True,
            "clean_environment": True,
            "private_workdir": True,
            "stdio_devnull": True,
            "expected_values_in_child": False,
            "one_job_per_child": True,
            "max_result_bytes": zygote.hello.get("max_result_bytes"),
            "stale_servers_reaped_at_start": self._pool.reaped,
            "child_exit_wakeup": "SIGCHLD",
            "preloaded_modules": len(zygote.hello.get("preloaded", [])),
            "setup_errors": [*zygote.start_errors, *sandbox.get("errors", [])],
        }

    def missing_protections(self) -> list[str]:
        """Names of the promised protections (PROMISED) that are not active on this machine; empty when all are."""
        active = self.protections
        missing = [name for name in PROMISED if not active.get(name)]
        if active.get("private_tmpfs") and set(PRIVATE_TMPFS) - set(active["private_tmpfs"]):
            missing.append("private_tmpfs " + " ".join(sorted(set(PRIVATE_TMPFS) - set(active["private_tmpfs"]))))
        return missing

    def summary(self) -> str:
        """One line for logs at start-up: what isolates candidates here, or what is missing."""
        if self.missing:
            errors = self.protections["setup_errors"]
            why = f"; first set-up error: {' '.join(errors[0].split())[-300:]}" if errors else ""
            return f"verifier: weaker sandbox, not active here: {', '.join(self.missing)} (see docs/verifier.md){why}"
        return ("verifier: kernel isolation active (private root without the project's files, seccomp allowlist, "
                "mount/PID/IPC/network namespaces, private tmpfs, uid " + str(self.protections["unprivileged_uid"]) +
                ", rlimits); audit hook for messages")

    # -- checking ------------------------------------------------------------------------------------------------
    def check(self, source: str, entry_point: str, tests: Sequence[Test]) -> Verdict:
        """Run one candidate against `tests` = [(args_tuple, expected), ...]."""
        return self.check_many([(source, entry_point, tests)])[0]

    def check_many(self, items: Sequence[tuple[str, str, Sequence[Test]]]) -> list[Verdict]:
        """Check many candidates in parallel across the workers; verdicts in input order.

        Every item is validated before anything runs, so bad input raises TypeError/ValueError in the caller.
        """
        if self.closed:
            raise VerifierClosedError("the verifier is closed")
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise TypeError("check_many expects a sequence of (source, entry_point, tests) tuples")
        prepared = []
        for position, item in enumerate(items):
            if not isinstance(item, (tuple, list)) or len(item) != 3:
                raise TypeError(f"item {position}: expected a (source, entry_point, tests) tuple")
            prepared.append(_prepare(*item))
        if not prepared:
            return []
        jobs = []
        for source, entry_point, inputs, _ in prepared:
            jobs.append({"id": self._pool.next_id(), "source": source, "entry_point": entry_point,
                         "inputs": inputs, "nonce": secrets.token_hex(8)})
        replies = self._pool.run(jobs, self.timeout_s)
        verdicts = []
        for job, (_, entry_point, _, tests), reply in zip(jobs, prepared, replies):
            verdicts.append(judge(reply, job["nonce"], entry_point, tests, self.timeout_s))
            self._record_timing(reply)
        return verdicts

    def _record_timing(self, reply: Any) -> None:
        """Accumulate the per-candidate cost breakdown (used by the benchmark): fork, setup, run, cleanup."""
        header = reply.header
        if reply.error is not None or not header or header.get("timed_out"):
            return
        try:
            started = float(reply.payload.split(b"\n", 1)[0][5:-1])  # ["t",<time>]: confinement done
            t_fork, t_child, t_job = float(header["t_fork"]), float(header["t_child"]), float(header["t_job"])
            t_exit, t_done = float(header["t_exit"]), float(header["t_done"])
        except (ValueError, KeyError, TypeError, IndexError):
            return
        if not t_fork <= t_child <= t_job <= started <= t_exit <= t_done:
            return
        self.stats["candidates"] += 1
        self.stats["fork_s"] += t_child - t_fork
        self.stats["setup_s"] += started - t_job
        self.stats["run_s"] += t_exit - started
        self.stats["cleanup_s"] += t_done - t_exit
        self.stats["round_trip_s"] += reply.done_at - reply.sent_at


def _prepare(source: Any, entry_point: Any, tests: Any) -> tuple[str, str, list, list[Test]]:
    """Validate one item; returns (source, entry_point, argument tuples, tests with expected values snapshotted)."""
    if not isinstance(source, str):
        raise TypeError(f"source must be a str, got {type(source).__name__}")
    source = str.__str__(source)
    if len(source) > MAX_SOURCE_CHARS:
        raise ValueError(f"source is longer than {MAX_SOURCE_CHARS} characters")
    if not isinstance(entry_point, str):
        raise TypeError(f"entry_point must be a str, got {type(entry_point).__name__}")
    entry_point = str.__str__(entry_point)
    if not entry_point.isidentifier() or keyword.iskeyword(entry_point):
        raise ValueError(f"entry_point must be a Python identifier, got {entry_point!r}")
    if isinstance(tests, (str, bytes)) or not isinstance(tests, (list, tuple)):
        raise TypeError("tests must be a list of (args_tuple, expected) pairs")
    if not tests:
        raise ValueError("tests must not be empty (a candidate with no tests would pass vacuously)")
    if len(tests) > MAX_TESTS:
        raise ValueError(f"at most {MAX_TESTS} tests per candidate")
    inputs, snapshot = [], []
    for index, case in enumerate(tests):
        if not isinstance(case, (tuple, list)) or len(case) != 2 or type(case[0]) is not tuple:
            raise TypeError(f"test {index}: expected an (args_tuple, expected) pair, got {case!r:.80}")
        args, expected = case
        try:
            args_text = protocol.encode(args)
            expected_value = protocol.loads(protocol.encode(expected))
        except protocol.EncodeError as exc:
            raise TypeError(f"test {index}: {exc}") from None
        inputs.append(protocol.loads(args_text))  # a fresh copy of the validated arguments, exact types
        snapshot.append((args, expected_value))
    return source, entry_point, inputs, snapshot

