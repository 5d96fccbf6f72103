"""The kernel-enforced syscall allowlist of every sandbox server: a seccomp-bpf filter built with libseccomp.

Why: the candidate is assumed to run arbitrary native code inside its child (CPython is not a sandbox, and the audit
hook lives in the candidate's own memory). Only what the kernel enforces holds then. The launcher loads this filter
once per server, right before it execs the zygote, so the zygote and every child it forks inherit it (a filter can
never be removed, only made stricter); the per-verdict cost is the kernel's evaluation of the filter on each syscall
(allowed syscalls without argument checks hit the kernel's constant-action cache and skip the BPF program).

The filter is built by libseccomp (the system library `libseccomp.so.2`; it resolves syscall names per
architecture and generates the BPF), called through ctypes from the launcher only: no hand-written BPF. Anything not
listed below fails with EPERM, so honest code gets an ordinary `PermissionError` instead of a dead process.

What is deliberately *not* allowed (the issue's list, and why), among everything else not listed:
* keyctl/add_key/request_key: kernel keyrings outlive the process and are shared by every process of the uid;
* unshare/setns/mount/umount2/pivot_root/chroot, clone with CLONE_NEW* flags, clone3 (flags hidden in a struct:
  ENOSYS, so libc falls back to clone): no new namespaces, no view of other ones;
* pidfd_*, kill of other processes is contained by the PID namespace; ptrace, process_vm_*, kcmp: other processes;
* setpriority, sched_set*, ioprio_set: renicing anything (the uid's other processes included);
* bpf, perf_event_open, io_uring_*, userfaultfd, open_by_handle_at, memfd_create: kernel attack surface / escapes;
* flock and the fcntl lock/lease/notify/owner commands: a lock on a shared read-only inode (the standard library)
  is a channel between candidates; seccomp cannot tell the child's own files apart, so every lock is refused;
* inotify/fanotify: watching shared files is a channel; mincore, preadv2 (RWF_NOWAIT), cachestat: page-cache
  residency probes; fadvise64, readahead, madvise other than the advice malloc uses: page-cache eviction/fill;
* sync/syncfs/sync_file_range: host-wide write-back storms; fsync/fdatasync return 0 without running (on a
  read-only descriptor of a host file they flush the host disk's cache; the job's own files live on tmpfs);
* socket/connect/bind: only socketpair(AF_UNIX, SOCK_STREAM) (asyncio's self-pipe) is allowed;
* prlimit64 on another process; SysV/POSIX IPC; everything else not needed by CPython.

Issue 46 (no kernel object, counter or resource shared between candidates or outliving a job), by argument:
* futex only with FUTEX_PRIVATE_FLAG: a shared futex is keyed on the inode of the file it maps, and every server
  maps the same host files (the interpreter, the standard library); futex_waitv refused (flags hidden in memory);
* sendmsg refused: SCM_RIGHTS is the only way to put a descriptor in flight, and a socket holding descriptors in
  its own queue outlives every process (freed only by the unix garbage collector); in-flight descriptors are also
  counted per uid (a value another candidate could read); setsockopt refused: SO_SNDBUF raises a socket's kernel
  buffer to 2 x net.core.wmem_max, memory that RLIMIT_AS does not count;
* prctl by option (no PR_SET_DUMPABLE: it makes /proc/self/pagemap readable, a page-cache residency probe);
* open/openat/F_SETFL without O_DIRECT (host disk reads that bypass the page cache); openat2 ENOSYS;
* preadv2/pwritev2 with flags 0 only (CPython's os.preadv; RWF_NOWAIT would probe residency);
* sysinfo refused (host-wide memory counters, Shmem included).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
from typing import Any

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_EQ, SCMP_CMP_MASKED_EQ = 4, 7
SCMP_FLTATR_CTL_OPTIMIZE = 8


def SCMP_ACT_ERRNO(code: int) -> int:  # noqa: N802 - the C macro's name
    return 0x00050000 | (code & 0xFFFF)


# Syscalls CPython 3.11, its standard library and the zygote need, allowed whatever their arguments.
ALLOWED = (
    # files and directories (the mount namespace decides what exists; tmpfs mounts are the only writable places)
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "lseek", "close", "close_range",
    "creat", "stat", "fstat", "lstat", "newfstatat", "statx", "access", "faccessat", "faccessat2",
    "readlink", "readlinkat", "getcwd", "chdir", "fchdir", "getdents", "getdents64", "mkdir", "mkdirat", "rmdir",
    "unlink", "unlinkat", "rename", "renameat", "renameat2", "link", "linkat", "symlink", "symlinkat", "chmod",
    "fchmod", "fchmodat", "chown", "fchown", "fchownat", "lchown", "utime", "utimes", "utimensat", "futimesat",
    "truncate", "ftruncate", "fallocate", "statfs", "fstatfs", "umask", "dup", "dup2", "dup3",
    "pipe", "pipe2", "splice", "tee", "sendfile", "copy_file_range", "getxattr", "lgetxattr", "fgetxattr",
    # memory
    "brk", "mmap", "munmap", "mremap", "mprotect", "msync",
    # processes and threads of its own (RLIMIT_NPROC = 0 stops the candidate from creating any)
    "fork", "vfork", "execve", "wait4", "waitid", "exit", "exit_group", "getpid", "getppid", "gettid", "getpgid",
    "getpgrp", "setpgid", "getsid", "setsid", "set_tid_address", "set_robust_list", "rseq", "arch_prctl",
    "sched_yield", "sched_getaffinity", "sched_getparam", "sched_getscheduler", "getpriority", "getcpu",
    "getuid", "geteuid", "getgid", "getegid", "getgroups", "getresuid", "getresgid", "setuid", "setgid", "setgroups",
    "setresuid", "setresgid", "setreuid", "setregid", "capget", "getrlimit", "setrlimit", "getrusage", "times",
    "uname", "restart_syscall",
    # signals (kill reaches only processes of its own PID namespace and uid) and time
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigsuspend", "rt_sigtimedwait",
    "sigaltstack", "kill", "tgkill", "tkill", "setitimer", "getitimer", "alarm", "clock_gettime", "clock_getres",
    "clock_nanosleep", "nanosleep", "gettimeofday", "time", "getrandom",
    # waiting
    "poll", "ppoll", "select", "pselect6", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait", "epoll_pwait",
    "epoll_pwait2",
    # an already connected local socket pair (asyncio's self-pipe); creating it is checked below. No sendmsg (the
    # only way to put a descriptor in flight, SCM_RIGHTS) and no setsockopt (SO_SNDBUF up to 2 x wmem_max).
    "sendto", "recvfrom", "recvmsg", "shutdown", "getsockopt", "getsockname", "getpeername",
)

# fcntl commands: fd flags, duplication and reading a pipe's size only (no locks, leases, dnotify, owner/signal
# routing, and no F_SETPIPE_SZ: up to 1 MiB of kernel memory per pipe; the launcher sizes the zygote's pipe first).
F_DUPFD, F_GETFD, F_SETFD, F_GETFL, F_SETFL = 0, 1, 2, 3, 4
F_DUPFD_CLOEXEC, F_GETPIPE_SZ = 1030, 1032
FCNTL_COMMANDS = (F_DUPFD, F_GETFD, F_SETFD, F_GETFL, F_DUPFD_CLOEXEC, F_GETPIPE_SZ)  # F_SETFL: checked below
# ioctl: what `isatty`, `os.set_blocking`/FIONBIO, FIOCLEX and FIONREAD need.
IOCTL_COMMANDS = (0x5401, 0x541B, 0x5421, 0x5450, 0x5451)  # TCGETS FIONREAD FIONBIO FIONCLEX FIOCLEX
# madvise: what malloc and the loader use on their own memory; no PAGEOUT/COLD/WILLNEED/REMOVE on shared pages.
MADVISE_ADVICE = (0, 1, 2, 4, 8, 14, 15, 16, 17)  # NORMAL RANDOM SEQUENTIAL DONTNEED FREE (NO)HUGEPAGE DONT/DODUMP
CLONE_NAMESPACE_FLAGS = 0x7E020000 | 0x00000080  # NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET + NEWTIME
AF_UNIX, SOCK_STREAM, SOCK_TYPE_MASK = 1, 1, 0xF
# Issue 46: integer arguments that decide whether a call touches state shared beyond the job.
FUTEX_PRIVATE_FLAG = 128  # without it a futex is keyed on the inode of a shared file: a channel between candidates
O_DIRECT = 0o40000  # reads that bypass the page cache and hit the host disk
# prctl options honest code and CPython may use; PR_SET_DUMPABLE (4) is absent: it would make /proc/self/pagemap
# readable (page-cache residency of shared files through fault-around).
PRCTL_OPTIONS = (2, 3, 15, 16, 21, 23, 30, 37, 39, 42, 0x53564D41)  # GET_PDEATHSIG GET_DUMPABLE SET/GET_NAME
# GET_SECCOMP CAPBSET_READ GET_TIMERSLACK GET_CHILD_SUBREAPER GET_NO_NEW_PRIVS GET_THP_DISABLE SET_VMA

# What the issue requires denied; `build` checks that none of them slipped into the allowlist.
MUST_DENY = ("keyctl", "add_key", "request_key", "unshare", "setns", "mount", "pidfd_open", "pidfd_send_signal",
             "pidfd_getfd", "setpriority", "ptrace", "process_vm_readv", "process_vm_writev", "bpf",
             "perf_event_open", "io_uring_setup", "io_uring_enter", "io_uring_register", "flock", "fadvise64",
             "sync", "syncfs", "mincore", "inotify_init1", "memfd_create", "open_by_handle_at", "userfaultfd",
             "sendmsg", "sendmmsg", "setsockopt", "sysinfo", "futex_waitv", "openat2")


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


_LOADED: list[Any] = []


def _library() -> Any:
    """libseccomp through ctypes; loaded once (the launcher calls this before pivoting into the private root,
    whose resident copy holds only what the interpreter and its extension modules link against)."""
    if _LOADED:
        return _LOADED[0]
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    lib = ctypes.CDLL(name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    _LOADED.append(lib)
    return lib


def install(off: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Build the filter and load it into this process (inherited by execve and every fork). Raises OSError.

    `off`: names of issue-46 defences switched off by the test-only switch (defences.py); empty in training."""
    lib = _library()
    ctx = lib.seccomp_init(SCMP_ACT_ERRNO(errno.EPERM))
    if not ctx:
        raise OSError(errno.ENOMEM, "seccomp_init failed")
    allowed: list[str] = []

    def rule(name: str, action: int = SCMP_ACT_ALLOW, *conditions: tuple[int, int, int, int]) -> None:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:
            return  # not a syscall on this architecture (e.g. "open" on arm64)
        array = (_ArgCmp * max(1, len(conditions)))(*[_ArgCmp(*c) for c in conditions])
        result = lib.seccomp_rule_add_array(ctx, action, number, len(conditions), array)
        if result < 0:
            raise OSError(-result, f"seccomp rule for {name}: {errno.errorcode.get(-result, result)}")
        if action == SCMP_ACT_ALLOW and name not in allowed:
            allowed.append(name)

    try:
        lib.seccomp_attr_set(ctx, SCMP_FLTATR_CTL_OPTIMIZE, 2)  # binary tree (libseccomp >= 2.5); best effort
        for name in ALLOWED:
            rule(name)
        for command in FCNTL_COMMANDS:
            rule("fcntl", SCMP_ACT_ALLOW, (1, SCMP_CMP_EQ, command, 0))
        for command in IOCTL_COMMANDS:
            rule("ioctl", SCMP_ACT_ALLOW, (1, SCMP_CMP_MASKED_EQ, 0xFFFFFFFF, command))
        for advice in MADVISE_ADVICE:
            rule("madvise", SCMP_ACT_ALLOW, (2, SCMP_CMP_EQ, advice, 0))
        rule("clone", SCMP_ACT_ALLOW, (0, SCMP_CMP_MASKED_EQ, CLONE_NAMESPACE_FLAGS, 0))
        rule("clone3", SCMP_ACT_ERRNO(errno.ENOSYS))
        rule("prlimit64", SCMP_ACT_ALLOW, (0, SCMP_CMP_EQ, 0, 0))
        _argument_checked_rules(rule, off)
        leaked = [name for name in MUST_DENY if name in allowed and name not in _switched(off)]
        if leaked:
            raise OSError(errno.EINVAL, f"seccomp allowlist contains {leaked}")
        result = lib.seccomp_load(ctx)
        if result < 0:
            raise OSError(-result, f"seccomp_load: {errno.errorcode.get(-result, result)}")
    finally:
        lib.seccomp_release(ctx)
    return {"allowed_syscalls": len(allowed), "default": "EPERM",
            "denied": [name for name in MUST_DENY if name not in _switched(off)], "defences_off": sorted(off)}


def _switched(off: frozenset[str]) -> set[str]:
    """Syscalls of MUST_DENY that a switched-off defence allows again (test-only)."""
    names = set()
    if "sendmsg" in off:
        names |= {"sendmsg"}
    if "sockets" in off:
        names |= {"setsockopt"}
    if "proc_view" in off:
        names |= {"sysinfo"}
    return names


def _argument_checked_rules(rule: Any, off: frozenset[str]) -> None:
    """Issue 46: calls allowed only with the arguments that keep them inside the job (see the module docstring)."""
    if "futex" in off:
        rule("futex")
    else:
        rule("futex", SCMP_ACT_ALLOW, (1, SCMP_CMP_MASKED_EQ, FUTEX_PRIVATE_FLAG, FUTEX_PRIVATE_FLAG))
    rule("futex_waitv", SCMP_ACT_ERRNO(errno.ENOSYS))  # per-waiter flags live in memory: not checkable
    if "prctl" in off:
        rule("prctl")
    else:
        for option in PRCTL_OPTIONS:
            rule("prctl", SCMP_ACT_ALLOW, (0, SCMP_CMP_EQ, option, 0))
    if "odirect" in off:
        rule("open")
        rule("openat")
    else:
        rule("open", SCMP_ACT_ALLOW, (1, SCMP_CMP_MASKED_EQ, O_DIRECT, 0))
        rule("openat", SCMP_ACT_ALLOW, (2, SCMP_CMP_MASKED_EQ, O_DIRECT, 0))
    rule("openat2", SCMP_ACT_ERRNO(errno.ENOSYS))  # flags in a struct; libc falls back to openat
    # F_SETFL without O_DIRECT (O_DIRECT can be switched on after open)
    rule("fcntl", SCMP_ACT_ALLOW, (1, SCMP_CMP_EQ, F_SETFL, 0),
         *(() if "odirect" in off else ((2, SCMP_CMP_MASKED_EQ, O_DIRECT, 0),)))
    # A read-only descriptor of a host file flushes the host disk's cache. (msync is no such route: a read-only
    # descriptor never gives a VM_SHARED mapping, so msync never reaches the file system for it.)
    for name in ("fsync", "fdatasync"):
        if "sync" in off:
            rule(name)
        else:
            rule(name, SCMP_ACT_ERRNO(0))  # a no-op that succeeds: the job's files are on tmpfs, which needs none
    for name in ("preadv2", "pwritev2"):  # CPython's os.preadv/os.pwritev; flags (RWF_NOWAIT: residency) must be 0
        rule(name, SCMP_ACT_ALLOW, (5, SCMP_CMP_EQ, 0, 0))
    if "sendmsg" in off:
        rule("sendmsg")
    if "sockets" in off:
        rule("setsockopt")
        rule("socketpair", SCMP_ACT_ALLOW, (0, SCMP_CMP_EQ, AF_UNIX, 0))
    else:
        rule("socketpair", SCMP_ACT_ALLOW, (0, SCMP_CMP_EQ, AF_UNIX, 0),
             (1, SCMP_CMP_MASKED_EQ, SOCK_TYPE_MASK, SOCK_STREAM))
    if "proc_view" in off:
        rule("sysinfo")
