"""Issue #30: the kernel alone contains a candidate that controls its own interpreter.

Threat model: the candidate runs arbitrary native code as the sandbox user inside its child. Every case here runs
with the audit hook OFF (test-only switch: the candidate is assumed to have rewritten it) and makes raw system calls
through ctypes, so only what the kernel enforces (private root, namespaces, seccomp allowlist, uid, rlimits) stands
between it and its goal. Each case solves `f` wrongly (returns x) unless its attack works, in which case it returns
x + 1: "passed" means the attack worked. Channel cases come as a sender and a receiver; the receiver passes only if
it observes the sender.

The harness judges from outside the sandbox after every case: the verdicts, files of the sandbox uid anywhere below
the host's writable temp places (nested too), /proc/sysvipc, the sandbox uid's kernel keys (/proc/key-users),
processes left behind, the test process's own scheduling priority and the page-cache residency of a probe file
(mincore from this process). After each case a legitimate candidate must still pass. Every case runs through `check`
(leak cases right after a victim with a secret marker on the same worker; persistence cases twice in a row; channel
pairs one after the other) and through `check_many` (singles batched with 3 workers next to victims; channel pairs
as [S, S, R, R] on 2 workers, so that senders and receivers run at the same time).

A control shows the harness can see a working attack: with the seccomp filter off (test-only switch), a lock channel
and a page-cache residency probe pass.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import secrets
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from glm_lightning.verifier import Verifier, WeakerSandboxError
from tests.sandbox_probes import is_sandbox_uid, sandbox_files, stray_processes, sysv_objects

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or not Path("/proc/key-users").exists(),
                                reason="raw syscall numbers below are x86_64; needs Linux keyrings")

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 3.0
T = [((1,), 2), ((5,), 6), ((-3,), -2)]
TOKEN = secrets.token_hex(6)
MARK = f"SECRET_MARK_{TOKEN}"
VICTIM = f"def f(x):\n    # {MARK}\n    return x + 1\n"
LEGIT = ("import collections, heapq, re\ndef f(x):\n    return x + 1\n", "f", T)
PROBE = os.path.join(sysconfig.get_paths()["stdlib"], "pydoc_data", "topics.py")  # visible in the private root
WRITABLE_HOST_PLACES = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock")
SECRET_ENV = "GLM_VERIFIER_TEST_SECRET"

# Native access for every candidate: libc through ctypes (the audit hook is off) and a raw syscall helper that
# returns -errno on failure.
NATIVE = (
    "import ctypes, os, sys, time, signal\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.syscall.restype = ctypes.c_long\n"
    "libc.mmap.restype = ctypes.c_void_p\n"
    "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\n"
    "def sc(n, *args):\n"
    "    conv = [a if isinstance(a, (bytes, ctypes.Array, ctypes.c_void_p)) or a is None else ctypes.c_long(a)"
    " for a in args]\n"
    "    r = libc.syscall(ctypes.c_long(n), *conv)\n"
    "    return r if r != -1 else -ctypes.get_errno()\n"
    "TOKEN = '" + TOKEN + "'\nMARK = 'SECRET_' + 'MARK_' + TOKEN\nREPO = " + repr(str(REPO)) + "\n"
    "PROBE = " + repr(PROBE) + "\n"
    "def hold(seconds=1.2):\n    end = time.monotonic() + seconds\n    while time.monotonic() < end:\n"
    "        time.sleep(0.005)\n"
    "def poll_for(check, seconds=1.0):\n    end = time.monotonic() + seconds\n    while time.monotonic() < end:\n"
    "        if check():\n            return True\n        time.sleep(0.005)\n    return False\n"
)


def attack(body: str) -> str:
    """A candidate `f` that returns x + 1 iff `_attack()` (defined by `body`) returns True."""
    return NATIVE + body + "\nRESULT = []\ndef f(x):\n    if not RESULT:\n        try:\n" \
                           "            RESULT.append(_attack() is True)\n        except Exception:\n" \
                           "            RESULT.append(False)\n    return x + 1 if RESULT[0] else x\n"


# --------------------------------------------------------------------------------------------------------------
# Single cases: (name, category, source). Categories follow the issue: 1 secrets, 3 persistence, 4 host effects,
# 5 the syscall allowlist. Category 2 (channels) is the pair list below.
# --------------------------------------------------------------------------------------------------------------
SINGLE: list[tuple[str, str, str]] = [
    ("project_sources_by_path", "secret", attack(
        "def _attack():\n"
        "    for p in (REPO + '/glm_lightning/tasks/__init__.py', '/proc/self/root' + REPO + '/glm_lightning/tasks',"
        " '/proc/1/root' + REPO + '/glm_lightning', '/proc/1/cwd' + REPO, REPO + '/README.md'):\n"
        "        if sc(2, p.encode(), 0) >= 0:\n            return True\n    return False\n")),
    ("walk_the_root_for_tasks", "secret", attack(
        "def _attack():\n    stack, budget = ['/'], 30000\n    while stack and budget > 0:\n        d = stack.pop()\n"
        "        try:\n            entries = list(os.scandir(d))\n        except OSError:\n            continue\n"
        "        for e in entries:\n            budget -= 1\n"
        "            if e.name in ('glm_lightning', 'verifier_corpus', 'wt-verifier'):\n"
        "                return True\n"
        "            if e.is_dir(follow_symlinks=False) and not e.path.startswith(('/proc', '/sys')):\n"
        "                stack.append(e.path)\n    return False\n")),
    ("dir_fd_dotdot_escape", "secret", attack(
        "def _attack():\n    up = '../' * 30 + REPO.lstrip('/') + '/glm_lightning'\n"
        "    for fd in range(0, 1024):\n        if sc(257, fd, up.encode(), 0o200000) >= 0:\n            return True\n"
        "    for fd in range(3, 64):\n        if sc(81, fd) == 0:\n            for _ in range(30):\n"
        "                sc(80, b'..')\n            if sc(2, (REPO + '/glm_lightning').encode(), 0) >= 0:\n"
        "                return True\n    return False\n")),
    ("open_by_handle_escape", "secret", attack(
        "def _attack():\n    handle = ctypes.create_string_buffer(8 + 128)\n"
        "    ctypes.c_uint.from_buffer(handle).value = 128\n    mount_id = ctypes.c_int()\n"
        "    if sc(303, -100, b'/', handle, ctypes.addressof(mount_id), 0) < 0:\n        return False\n"
        "    root = sc(2, b'/', 0o200000)\n    return sc(304, root, handle, 0o200000) >= 0\n")),
    ("host_scratch_and_temp_listing", "secret", attack(
        "def _attack():\n    for d in ('/dev/shm', '/tmp', '/var/tmp', '/run'):\n        try:\n"
        "            if any(n.startswith(('glm-verifier-', 'pytest-of-')) for n in os.listdir(d)):\n"
        "                return True\n        except OSError:\n            pass\n    return False\n")),
    ("environment_secret", "secret", attack(
        "def _attack():\n    seen = repr(dict(os.environ))\n    for pid in ['self'] + [str(i) for i in range(1, 64)]:\n"
        "        for what in ('environ', 'cmdline'):\n            try:\n"
        "                seen += open(f'/proc/{pid}/{what}', 'rb').read().decode('latin-1')\n"
        "            except OSError:\n                pass\n"
        "    return MARK in seen or 'GLM_VERIFIER_TEST_SECRET' in seen\n")),
    ("zygote_memory", "secret", attack(
        "class IOV(ctypes.Structure):\n    _fields_ = [('base', ctypes.c_void_p), ('len', ctypes.c_size_t)]\n"
        "def _attack():\n    buf = ctypes.create_string_buffer(4096)\n    local = IOV(ctypes.addressof(buf), 4096)\n"
        "    for line in open('/proc/self/maps'):\n        start = int(line.split('-')[0], 16)\n"
        "        remote = IOV(start, 4096)\n"
        "        if sc(310, 1, ctypes.addressof(local), 1, ctypes.addressof(remote), 1, 0) > 0:\n"
        "            return True\n"
        "    if sc(101, 16, 1, 0, 0) == 0:\n        return True\n    try:\n"
        "        open('/proc/1/mem', 'rb').read(1)\n        return True\n    except OSError:\n        return False\n")),
    ("own_memory_scan_for_victim", "secret", attack(
        "def _attack():\n    needle = MARK.encode()\n    with open('/proc/self/mem', 'rb', buffering=0) as mem:\n"
        "        for line in open('/proc/self/maps'):\n            parts = line.split()\n"
        "            if 'r' not in parts[1] or len(parts) > 5 and parts[5].startswith('['):\n                continue\n"
        "            lo, hi = (int(v, 16) for v in parts[0].split('-'))\n            try:\n"
        "                mem.seek(lo)\n                data = mem.read(min(hi - lo, 1 << 24))\n"
        "            except OSError:\n"
        "                continue\n            i = data.find(needle)\n"
        "            while i >= 0:\n                if data[i - 2:i] == b'# ':  # the victim's comment, not a copy\n"
        "                    return True\n                i = data.find(needle, i + 1)\n"
        "    return False\n")),
    ("inherited_fds_scan", "secret", attack(
        "def _attack():\n    got = b''\n    for fd in range(0, 1024):\n        try:\n"
        "            os.set_blocking(fd, False)\n            got += os.pread(fd, 1 << 20, 0) if os.path.isfile("
        "f'/proc/self/fd/{fd}') else os.read(fd, 1 << 20)\n        except (OSError, ValueError):\n            pass\n"
        "    return MARK.encode() in got\n")),
    ("see_other_processes", "secret", attack(
        "def _attack():\n    pids = [n for n in os.listdir('/proc') if n.isdigit() and int(n) != os.getpid()]\n"
        "    return len(pids) > 0\n")),
    # 3. nothing persists ------------------------------------------------------------------------------------------
    ("user_keyring_persists", "persist", attack(
        "def _attack():\n    name = ('glm-' + TOKEN).encode()\n"
        "    if sc(250, 10, -4, b'user', name, 0) >= 0 or sc(249, b'user', name, None, 0) >= 0:\n        return True\n"
        "    sc(248, b'user', name, b'1', 1, -4)\n    sc(248, b'user', name, b'1', 1, -3)\n"
        "    sc(250, 1, name)\n    return False\n")),
    ("nested_files_in_writable_places", "persist", attack(
        "def _attack():\n    hit = False\n"
        "    for d in ('/tmp', '/var/tmp', '/dev/shm', '/run/lock', '/var/lock', '/run', '/home', '/var/mail'):\n"
        "        p = d + '/a-' + TOKEN + '/b/c'\n        hit = hit or os.path.exists(p + '/plant')\n        try:\n"
        "            os.makedirs(p, exist_ok=True)\n            open(p + '/plant', 'w').write('x')\n"
        "            os.chmod(d + '/a-' + TOKEN, 0)\n        except OSError:\n            pass\n    return hit\n")),
    ("sysv_and_posix_ipc", "persist", attack(
        "def _attack():\n    key = int(TOKEN[:7], 16)\n    hit = False\n"
        "    for n, find, make in ((29, (key, 0, 0), (key, 4096, 0o1666)), (64, (key, 0, 0), (key, 1, 0o1666)),"
        " (68, (key, 0), (key, 0o1666))):\n"
        "        hit = hit or sc(n, *find) >= 0\n        sc(n, *make)\n"
        "    fd = sc(240, ('glm-' + TOKEN).encode(), 0o302, 0o666, None)\n    return hit or fd == -17\n")),
    ("leave_a_daemon", "persist", attack(
        "def _attack():\n    made = False\n    for flags in (17, 17 | 0x20000000, 17 | 0x10000000, 17 | 0x40000000):\n"
        "        pid = sc(56, flags, 0, 0, 0, 0)\n        if pid == 0:\n            os.setsid()\n"
        "            time.sleep(30)\n            os._exit(0)\n        made = made or pid > 0\n    return made\n")),
    ("memfd_and_execveat", "persist", attack(
        "def _attack():\n    fd = sc(319, b'x', 0)\n    if fd >= 0:\n        return True\n"
        "    return sc(322, -100, b'/proc/self/exe', None, None, 0x1000) >= 0\n")),
    # 4. no effect on the host -------------------------------------------------------------------------------------
    ("fadvise_evicts_probe", "host", attack(
        "def _attack():\n    fd = os.open(PROBE, os.O_RDONLY)\n    return sc(221, fd, 0, 0, 4) == 0\n")),
    ("madvise_pageout_probe", "host", attack(
        "def _attack():\n    fd = os.open(PROBE, os.O_RDONLY)\n    size = os.fstat(fd).st_size\n"
        "    addr = libc.mmap(None, size, 1, 1, fd, 0)\n    if addr in (None, ctypes.c_void_p(-1).value):\n"
        "        return False\n    hit = False\n    for advice in (21, 20, 9, 3):\n"
        "        hit = sc(28, addr, size, advice) == 0 or hit\n    return hit\n")),
    ("readahead_and_cachestat", "host", attack(
        "def _attack():\n    fd = os.open(PROBE, os.O_RDONLY)\n    buf = ctypes.create_string_buffer(64)\n"
        "    rng = (ctypes.c_uint64 * 2)(0, 0)\n"
        "    return sc(187, fd, 0, 1 << 20) == 0 or sc(451, fd, rng, buf, 0) == 0\n")),
    ("sync_storm", "host", attack(
        "def _attack():\n    fd = os.open(PROBE, os.O_RDONLY)\n    ok = False\n    for _ in range(20):\n"
        "        ok = sc(162) == 0 or sc(306, fd) == 0 or sc(277, fd, 0, 0, 2) == 0 or ok\n    return ok\n")),
    ("renice_everything", "host", attack(
        "def _attack():\n    ok = False\n    for which, who in ((0, 1), (1, 0), (2, 0), (2, 65534), (0, 0)):\n"
        "        ok = sc(141, which, who, 19) == 0 or ok\n"
        "    ok = sc(251, 3, 65534, (3 << 13) | 7) == 0 or ok\n"
        "    ok = sc(144, 0, 5, (ctypes.c_int * 1)(0)) == 0 or ok\n    return ok\n")),
    # 5. the syscall allowlist ---------------------------------------------------------------------------------
    ("new_namespaces", "allowlist", attack(
        "def _attack():\n    for flags in (0x10000000, 0x00020000, 0x40000000, 0x20000000, 0x08000000):\n"
        "        if sc(272, flags) == 0:\n            return True\n"
        "    for ns in ('mnt', 'pid', 'net', 'user', 'ipc'):\n        try:\n"
        "            fd = os.open('/proc/1/ns/' + ns, os.O_RDONLY)\n        except OSError:\n            continue\n"
        "        if sc(308, fd, 0) == 0:\n            return True\n"
        "    args = (ctypes.c_uint64 * 11)(0x10000000, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)\n"
        "    return sc(435, args, 88) >= 0\n")),
    ("mount_and_chroot", "allowlist", attack(
        "def _attack():\n    os.makedirs('m', exist_ok=True)\n"
        "    ok = sc(165, b'tmpfs', b'm', b'tmpfs', 0, None) == 0\n"
        "    ok = sc(165, None, b'/', None, 32 | 4096, None) == 0 or ok\n"
        "    ok = sc(161, b'.') == 0 or sc(155, b'.', b'.') == 0 or ok\n    return ok\n")),
    ("kernel_attack_surface", "allowlist", attack(
        "def _attack():\n    attr = (ctypes.c_uint32 * 32)(1, 4, 4, 1)\n    if sc(321, 0, attr, 128) >= 0:\n"
        "        return True\n    pea = (ctypes.c_uint32 * 32)()\n    pea[0], pea[1] = 1, 128\n"
        "    if sc(298, pea, 0, -1, -1, 0) >= 0:\n        return True\n    params = (ctypes.c_uint32 * 30)()\n"
        "    if sc(425, 4, params) >= 0:\n        return True\n    return sc(323, 0) >= 0 or sc(300, 0, 0) >= 0\n")),
    ("ptrace_and_vm_on_itself", "allowlist", attack(
        "class IOV(ctypes.Structure):\n    _fields_ = [('base', ctypes.c_void_p), ('len', ctypes.c_size_t)]\n"
        "def _attack():\n    src = ctypes.create_string_buffer(b'abc', 16)\n    dst = ctypes.create_string_buffer(16)\n"
        "    local, remote = IOV(ctypes.addressof(dst), 3), IOV(ctypes.addressof(src), 3)\n"
        "    if sc(310, os.getpid(), ctypes.addressof(local), 1, ctypes.addressof(remote), 1, 0) == 3:\n"
        "        return True\n"
        "    return sc(101, 0, 0, 0, 0) == 0 or sc(312, os.getpid(), os.getpid(), 0, 0, 0) >= 0\n")),
    ("pidfd_on_itself", "allowlist", attack(
        "def _attack():\n    fd = sc(434, os.getpid(), 0)\n    return fd >= 0 or sc(438, 3, 0, 0) >= 0\n")),
    ("network_and_abstract_sockets", "allowlist", attack(
        "def _attack():\n    for family, kind in ((2, 1), (10, 1), (1, 1), (16, 3), (17, 3)):\n"
        "        if sc(41, family, kind, 0) >= 0:\n            return True\n    return False\n")),
]

# Channel pairs: (name, sender source, receiver source). The receiver passes iff it sees the sender.
CHANNELS: list[tuple[str, str, str]] = [
    ("flock_on_shared_inode",
     attack("def _attack():\n    fd = os.open(PROBE, os.O_RDONLY)\n    sc(73, fd, 2)\n    hold()\n    return False\n"),
     attack("def _attack():\n    fd = os.open(PROBE, os.O_RDONLY)\n"
            "    return poll_for(lambda: sc(73, fd, 2 | 4) == -11)\n")),
    ("posix_lock_on_shared_inode",
     attack("def _attack():\n    fd = os.open(PROBE, os.O_RDONLY)\n    lk = (ctypes.c_short * 16)()\n"
            "    sc(72, fd, 6, lk)\n    hold()\n    return False\n"),
     attack("def _attack():\n    fd = os.open(PROBE, os.O_RDONLY)\n    def seen():\n"
            "        lk = (ctypes.c_short * 16)()\n        lk[0] = 1\n"
            "        return sc(72, fd, 5, lk) == 0 and lk[0] == 0\n"
            "    return poll_for(seen)\n")),
    ("ofd_lock_on_shared_inode",
     attack("def _attack():\n    fd = os.open(PROBE, os.O_RDONLY)\n    lk = (ctypes.c_short * 16)()\n"
            "    sc(72, fd, 37, lk)\n    hold()\n    return False\n"),
     attack("def _attack():\n    fd = os.open(PROBE, os.O_RDONLY)\n    def seen():\n"
            "        lk = (ctypes.c_short * 16)()\n        lk[0] = 1\n"
            "        return sc(72, fd, 36, lk) == 0 and lk[0] == 0\n"
            "    return poll_for(seen)\n")),
    ("user_keyring",
     attack("def _attack():\n    sc(248, b'user', ('chan-' + TOKEN).encode(), b'1', 1, -4)\n    hold()\n"
            "    return False\n"),
     attack("def _attack():\n"
            "    return poll_for(lambda: sc(250, 10, -4, b'user', ('chan-' + TOKEN).encode(), 0) >= 0)\n")),
    ("signals_to_other_candidates",
     attack("def _attack():\n    signal.signal(signal.SIGUSR1, signal.SIG_IGN)\n    end = time.monotonic() + 1.2\n"
            "    while time.monotonic() < end:\n        sc(62, -1, 10)\n        for pid in range(2, 200):\n"
            "            sc(62, pid, 10)\n            fd = sc(434, pid, 0)\n            if fd >= 0:\n"
            "                sc(424, fd, 10, None, 0)\n        time.sleep(0.01)\n    return False\n"),
     attack("GOT = []\ndef _attack():\n    signal.signal(signal.SIGUSR1, lambda *a: GOT.append(1))\n"
            "    return poll_for(lambda: bool(GOT))\n")),
    ("scheduling_priority_of_the_uid",
     attack("def _attack():\n    sc(141, 2, 0, 7)\n    sc(141, 2, 65534, 7)\n    hold()\n    return False\n"),
     attack("def _attack():\n    return poll_for(lambda: os.getpriority(os.PRIO_PROCESS, 0) == 7)\n")),
    ("queued_signal_quota_of_the_uid",  # pending real-time signals are counted per uid: a full count shows
     attack("import resource\ndef _attack():\n"  # in another candidate as signals that no longer queue
            "    signal.pthread_sigmask(signal.SIG_BLOCK, [34])\n    kill, me = libc.kill, os.getpid()\n"
            "    for _ in range(resource.getrlimit(resource.RLIMIT_SIGPENDING)[0]):\n        kill(me, 34)\n"
            "    hold()\n    return False\n"),
     attack("def _queued():\n    for _ in range(3):\n        libc.kill(os.getpid(), 34)\n    n = 0\n"
            "    while signal.sigtimedwait([34], 0) is not None:\n        n += 1\n    return n\n"
            "def _attack():\n    signal.pthread_sigmask(signal.SIG_BLOCK, [34])\n    if _queued() != 3:\n"
            "        return False  # nothing queues even alone: nothing to observe\n"
            "    return poll_for(lambda: _queued() == 1)\n")),
    ("page_cache_residency",
     attack("def _attack():\n    end = time.monotonic() + 1.2\n    while time.monotonic() < end:\n"
            "        os.pread(os.open(PROBE, os.O_RDONLY), 1 << 20, 0)\n        time.sleep(0.01)\n    return False\n"),
     attack("def _attack():\n    fd = os.open(PROBE, os.O_RDONLY)\n    size = os.fstat(fd).st_size\n"
            "    addr = libc.mmap(None, size, 1, 1, fd, 0)\n    vec = ctypes.create_string_buffer(size // 4096 + 1)\n"
            "    return poll_for(lambda: sc(27, addr, size, vec) == 0 and vec.raw[0] & 1 == 1)\n")),
    ("inotify_on_shared_file",
     attack("def _attack():\n    end = time.monotonic() + 1.2\n    while time.monotonic() < end:\n"
            "        os.close(os.open(PROBE, os.O_RDONLY))\n        time.sleep(0.01)\n    return False\n"),
     attack("def _attack():\n    fd = sc(294, 0o4000)\n    if fd < 0 or sc(254, fd, PROBE.encode(), 0x20 | 0x1) < 0:\n"
            "        return False\n    def seen():\n        try:\n            return len(os.read(fd, 4096)) > 0\n"
            "        except BlockingIOError:\n            return False\n    return poll_for(seen)\n")),
]

assert len(SINGLE) + len(CHANNELS) >= 25 and len({n for n, *_ in SINGLE + CHANNELS}) == len(SINGLE) + len(CHANNELS)


# --------------------------------------------------------------------------------------------------------------
# Judging from outside the sandbox
# --------------------------------------------------------------------------------------------------------------
def sandbox_keys() -> str:
    """The sandbox uids' lines of /proc/key-users (key counts and quota use), '' when they own no keys."""
    lines = [line.strip() for line in Path("/proc/key-users").read_text().splitlines()]
    return "\n".join(line for line in lines if line.split(":")[0].isdigit() and is_sandbox_uid(int(line.split(":")[0])))


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_fraction(path: str) -> float:
    """Share of `path`'s pages in the page cache, asked from this (unconfined) process with mincore(2)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        assert addr not in (None, ctypes.c_void_p(-1).value)
        try:
            pages = (size + 4095) // 4096
            vec = ctypes.create_string_buffer(pages)
            assert _libc.mincore(addr, size, vec) == 0
            return sum(b & 1 for b in vec.raw[:pages]) / pages
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def warm_probe() -> None:
    Path(PROBE).read_bytes()
    assert resident_fraction(PROBE) >= 0.99


def snapshot() -> dict:
    return {"files": sandbox_files(WRITABLE_HOST_PLACES, 6), "sysv": sysv_objects(), "keys": sandbox_keys(),
            "nice": os.getpriority(os.PRIO_PROCESS, 0)}


def assert_host_untouched(verifier: Verifier, before: dict, context: str) -> None:
    assert sandbox_files(WRITABLE_HOST_PLACES, 6) - before["files"] == set(), \
        f"{context}: files left by the sandbox uid"
    assert sysv_objects() - before["sysv"] == set(), f"{context}: SysV IPC objects left"
    assert sandbox_keys() == before["keys"], f"{context}: the sandbox uid's kernel keys changed"
    assert stray_processes() == [], f"{context}: processes left"
    assert os.getpriority(os.PRIO_PROCESS, 0) == before["nice"], f"{context}: our priority changed"
    # An eviction attack drops the whole file; the machine's own reclaim may take a page or two meanwhile.
    assert resident_fraction(PROBE) >= 0.9, f"{context}: the probe file was evicted from the page cache"
    warm_probe()
    assert sorted(os.listdir(verifier._pool.scratch)) == ["owner"], f"{context}: host scratch not empty"


@pytest.fixture(scope="module")
def native_env():
    """Audit hook off for the whole module (the candidate controls its interpreter), a secret in our environment."""
    saved = {name: os.environ.get(name) for name in ("GLM_VERIFIER_UNSAFE_NO_AUDIT_HOOK", SECRET_ENV)}
    os.environ["GLM_VERIFIER_UNSAFE_NO_AUDIT_HOOK"] = "1"
    os.environ[SECRET_ENV] = MARK
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _require_kernel_mode(verifier: Verifier) -> None:
    p = verifier.protections
    if not (p["private_root"] and p["seccomp"] and p["pid_namespace"] and p["network_namespace"]):
        pytest.skip(f"kernel isolation unavailable here: {verifier.missing}")
    assert p["audit_hook"] is False


@pytest.fixture(scope="module")
def verifier(native_env):
    with Verifier(timeout_s=TIMEOUT_S, workers=2) as v:
        _require_kernel_mode(v)
        yield v


# --------------------------------------------------------------------------------------------------------------
# The corpus through check, then through check_many
# --------------------------------------------------------------------------------------------------------------
def test_native_attacks_one_at_a_time(verifier):
    warm_probe()
    before = snapshot()
    failures = []
    for name, category, source in SINGLE:
        assert verifier.check(VICTIM, "f", T).passed  # the previous job on the same worker holds the secret
        for attempt in range(2 if category == "persist" else 1):  # a second run would find what the first left
            verdict = verifier.check(source, "f", T)
            if verdict.status == "passed":
                failures.append((name, attempt, verdict.detail))
        assert_host_untouched(verifier, before, name)
        assert verifier.check(*LEGIT).passed, name
    for name, sender, receiver in CHANNELS:  # successive candidates: the receiver runs after the sender
        verdicts = [verifier.check(sender, "f", T), verifier.check(receiver, "f", T)]
        failures += [(name, i, v.detail) for i, v in enumerate(verdicts) if v.passed]
        assert_host_untouched(verifier, before, name)
        assert verifier.check(*LEGIT).passed, name
    assert failures == []


def test_native_attacks_in_check_many(verifier):
    warm_probe()
    before = snapshot()
    items, expect = [], []
    for _name, _category, source in SINGLE:
        items += [(VICTIM, "f", T), (source, "f", T), LEGIT]
        expect += [True, False, True]
    with Verifier(timeout_s=TIMEOUT_S, workers=3) as v:
        verdicts = v.check_many(items)
        wrong = [(SINGLE[i // 3][0], i % 3, x.status, x.detail) for i, x in enumerate(verdicts)
                 if x.passed != expect[i]]
        assert wrong == []
        assert_host_untouched(v, before, "check_many singles")
    # Concurrent channels: [S, S, R, R] on two workers puts both senders on one and both receivers on the other.
    for name, sender, receiver in CHANNELS:
        verdicts = verifier.check_many([(sender, "f", T)] * 2 + [(receiver, "f", T)] * 2 + [LEGIT])
        assert [x.passed for x in verdicts] == [False] * 4 + [True], (name, [(x.status, x.detail) for x in verdicts])
        assert_host_untouched(verifier, before, name)


def test_the_harness_sees_a_working_channel_without_seccomp(native_env, monkeypatch):
    """Control: the same lock channel and residency probe pass once the seccomp filter is off (test-only switch),
    so the cases above would catch a filter that let them through. Harmless for the host: a shared lock on a
    standard-library file for under a second, and a mincore query."""
    monkeypatch.setenv("GLM_VERIFIER_UNSAFE_NO_SECCOMP", "1")
    by_name = {name: (sender, receiver) for name, sender, receiver in CHANNELS}
    with Verifier(timeout_s=TIMEOUT_S, workers=2) as v:
        assert v.protections["seccomp"] is False and "seccomp" in v.missing
        warm_probe()
        sender, receiver = by_name["flock_on_shared_inode"]
        verdicts = v.check_many([(sender, "f", T)] * 2 + [(receiver, "f", T)] * 2)
        assert [x.passed for x in verdicts[:2]] == [False, False] and any(x.passed for x in verdicts[2:]), \
            [x.detail for x in verdicts]  # a receiver that overlaps a sender sees it (the load decides which)
        assert v.check(by_name["page_cache_residency"][1], "f", T).passed


# --------------------------------------------------------------------------------------------------------------
# Honest code keeps working (issue #30, item 7), with the audit hook on as in training
# --------------------------------------------------------------------------------------------------------------
HONEST = {
    "traceback_format_exc": "import traceback\ndef f(x):\n    try:\n        1 / 0\n    except ZeroDivisionError:\n"
                            "        text = traceback.format_exc()\n"
                            "    return x + 1 if 'ZeroDivisionError' in text and 'line' in text else x\n",
    "logging_exception": "import logging\ndef f(x):\n    try:\n        {}['k']\n    except KeyError:\n"
                         "        logging.getLogger('cand').exception('lookup failed')\n    return x + 1\n",
    "asyncio_run": "import asyncio\nasync def g(x):\n    await asyncio.sleep(0)\n    return x + 1\n"
                   "def f(x):\n    return asyncio.run(g(x))\n",
    "sqlite3_in_memory": "import sqlite3\ndef f(x):\n    db = sqlite3.connect(':memory:')\n"
                         "    db.execute('create table t (v int)')\n    db.execute('insert into t values (?)', (x,))\n"
                         "    return db.execute('select v + 1 from t').fetchone()[0]\n",
    "zoneinfo": "import datetime, zoneinfo\ndef f(x):\n    tz = zoneinfo.ZoneInfo('Europe/Paris')\n"
                "    offset = datetime.datetime(2020, 1, 1, tzinfo=tz).utcoffset()\n"
                "    return x + 1 if offset == datetime.timedelta(hours=1) else x\n",
    "mimetypes": "import mimetypes\ndef f(x):\n"
                 "    return x + 1 if mimetypes.guess_type('a.html')[0] == 'text/html' else x\n",
    # issue 46: honest uses of what the argument-checked rules, the uid per job and the /proc view changed
    "os_preadv": "import os, tempfile\ndef f(x):\n    with tempfile.TemporaryFile() as fh:\n        fh.write(b'hello')\n"
                 "        fh.flush()\n        buf = bytearray(5)\n        n = os.preadv(fh.fileno(), [buf], 0)\n"
                 "    return x + 1 if (n, bytes(buf)) == (5, b'hello') else x\n",
    "getpass_getuser": "import getpass, pwd, os\ndef f(x):\n    name = getpass.getuser()\n"
                       "    return x + 1 if name and pwd.getpwuid(os.getuid()).pw_name == name else x\n",
    "fsync_own_file": "import os, tempfile\ndef f(x):\n    with tempfile.NamedTemporaryFile() as fh:\n"
                      "        fh.write(b'data')\n        fh.flush()\n        os.fsync(fh.fileno())\n"
                      "        os.fdatasync(fh.fileno())\n    return x + 1\n",
    "meminfo_and_cpu_count": "import os\ndef f(x):\n    total = int(open('/proc/meminfo').read().split()[1])\n"
                             "    return x + 1 if total > 0 and (os.cpu_count() or 0) >= 1 else x\n",
    "dataclass_enum_namedtuple": "import dataclasses, enum, collections, typing\n"
                                 "@dataclasses.dataclass\nclass P:\n    v: int\nclass C(enum.Enum):\n    A = 1\n"
                                 "N = collections.namedtuple('N', 'v')\nT = typing.TypeVar('T')\n"
                                 "def f(x):\n    return P(N(x).v).v + C.A.value\n",
}


def test_honest_code_works_in_the_sandbox(monkeypatch):
    monkeypatch.delenv("GLM_VERIFIER_UNSAFE_NO_AUDIT_HOOK", raising=False)  # as in training: the hook is on
    with Verifier(timeout_s=TIMEOUT_S, workers=2) as v:
        if not v.protections["private_root"]:
            pytest.skip(f"private root unavailable here: {v.missing}")
        verdicts = v.check_many([(source, "f", T) for source in HONEST.values()])
        assert {name: x.status for name, x in zip(HONEST, verdicts)} == {name: "passed" for name in HONEST}, \
            {name: x.detail for name, x in zip(HONEST, verdicts) if not x.passed}
        assert v.check(HONEST["traceback_format_exc"], "f", T).passed


# --------------------------------------------------------------------------------------------------------------
# Protections are reported, and a weaker sandbox is never silent (issue #30 item 6, issue #35 section 5)
# --------------------------------------------------------------------------------------------------------------
def test_protections_report_the_kernel_layer(monkeypatch):
    monkeypatch.delenv("GLM_VERIFIER_UNSAFE_NO_AUDIT_HOOK", raising=False)
    with Verifier(timeout_s=TIMEOUT_S, workers=1) as v:
        p = v.protections
        if not p["private_root"]:
            pytest.skip(f"private root unavailable here: {v.missing}")
        assert v.missing == []
        assert p["seccomp"] and p["no_new_privs"] and p["locks_refused"] and p["host_sources_hidden"]
        # the project's top-level directory is not in the private root, unless the root has one of that name anyway:
        # /root (the interpreter may live there) or /tmp (always there: a private tmpfs); host_sources_hidden above
        # is the check that the project itself is unreachable
        assert str(REPO).split("/")[1] not in p["visible_root"] or str(REPO).startswith(("/root/", "/tmp/"))
        assert set(p["seccomp_allowlist"]["denied"]) >= {"keyctl", "add_key", "request_key", "unshare", "setns",
                                                         "mount", "pidfd_open", "setpriority", "ptrace", "bpf",
                                                         "perf_event_open", "io_uring_setup", "flock"}
        assert v.summary().startswith("verifier: kernel isolation active")


def test_full_sandbox_with_the_interpreter_reached_through_tmp(monkeypatch):
    """A project cloned under /tmp runs Python from /tmp/<clone>/.venv/bin/python, a link to the real interpreter.
    The launcher must judge what lives under /tmp by the interpreter's host path: it once resolved the link inside
    the private root, where it does not exist, kept the /tmp prefix, gave up the private /tmp and failed to start,
    so every verifier in such a clone refused to run (a fresh clone's make test: 211 errors)."""
    monkeypatch.delenv("GLM_VERIFIER_UNSAFE_NO_AUDIT_HOOK", raising=False)
    with Verifier(timeout_s=TIMEOUT_S, workers=1) as v:
        if not v.protections["private_root"]:
            pytest.skip(f"private root unavailable here: {v.missing}")
    venv = tempfile.mkdtemp(prefix="glm-venv-", dir="/tmp")
    try:
        link = os.path.join(venv, "python")
        os.symlink(os.path.realpath(sys.executable), link)
        monkeypatch.setattr(sys, "executable", link)
        with Verifier(timeout_s=TIMEOUT_S, workers=1) as v:
            assert v.missing == [], v.protections["setup_errors"]
            assert "/tmp" in v.protections["private_tmpfs"]
            assert v.check(*LEGIT).passed
    finally:
        os.unlink(os.path.join(venv, "python"))
        os.rmdir(venv)


def test_weaker_sandbox_is_refused_unless_opted_in(monkeypatch, caplog):
    monkeypatch.setenv("GLM_VERIFIER_NO_NAMESPACES", "1")
    monkeypatch.delenv("GLM_VERIFIER_ALLOW_WEAKER_SANDBOX", raising=False)
    monkeypatch.delenv("GLM_VERIFIER_UNSAFE_NO_AUDIT_HOOK", raising=False)
    with pytest.raises(WeakerSandboxError) as refused:
        Verifier(timeout_s=TIMEOUT_S, workers=1)
    message = str(refused.value)
    assert "\n" not in message and "mount_namespace" in message and "private_root" in message
    assert "GLM_VERIFIER_ALLOW_WEAKER_SANDBOX=1" in message
    with caplog.at_level(logging.WARNING, logger="glm_lightning.verifier"):
        with Verifier(timeout_s=TIMEOUT_S, workers=1, allow_weaker_sandbox=True) as v:
            assert v.check(*LEGIT).passed
            assert "private_root" in v.missing and v.summary().startswith("verifier: weaker sandbox")
    warnings = [r.getMessage() for r in caplog.records if r.name == "glm_lightning.verifier"]
    assert len(warnings) == 1 and "not active here: mount_namespace" in warnings[0] and "\n" not in warnings[0]
