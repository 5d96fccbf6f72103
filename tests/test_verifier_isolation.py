"""Issue #15: hostile candidates that would PASS if their attack worked, one class of breach per section.

Every candidate solves `increment` (tests T) wrongly (it returns x) unless its attack succeeds, in which case it
returns x + 1: a "passed" verdict therefore means the attack worked. Leakage attacks look for a victim's source
(a correct solution carrying a unique marker that is run in the same batch) and return x + 1 only if they find it.
Each candidate runs through `check` (with a legitimate check afterwards) and, all together, through `check_many`
with three workers, each attacker followed by a victim (the next job on the same worker: a design that queued jobs
inside the server process would leak it; run against the previous design this suite finds that leak, the
int-to-str crash of the caller, memfd/re-import native-code holes and files left in /tmp and /dev/shm); after
each run the host is inspected for leftovers: files owned by the sandbox uid in /tmp, /var/tmp and /dev/shm, new
SysV IPC objects, and processes other than the servers.

A second group turns the audit hook off (test-only switch) to show what the kernel layer contains on its own, and
a third runs with namespaces disabled to exercise the documented fallback. The kill test SIGKILLs a caller in the
middle of `check_many` and shows that the next `Verifier()` start leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from glm_lightning.verifier import Verifier
from tests.sandbox_probes import SANDBOX_UID, sandbox_files, stray_processes, sysv_objects
from glm_lightning.verifier.judge import Reply, judge, printable, safe_repr

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 1.0
T = [((1,), 2), ((5,), 6), ((-3,), -2)]
TOKEN = secrets.token_hex(6)
MARK = f"VICTIM_MARK_{TOKEN}"
VICTIM = f"def f(x):\n    # {MARK}\n    return x + 1\n"
LEGIT = ("def f(x):\n    import collections, heapq, re\n    return x + 1\n", "f", T)
TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")

# Shared snippets. `_found(s)` is true for any string that contains the victim's marker but is not our own needle.
FINDER = (
    "_NEEDLE = 'VICTIM_' + 'MARK_' + '" + TOKEN + "'\n"
    "_MODULE = type(__import__('sys'))\n"
    "def _found(s):\n"
    "    return type(s) is str and s is not _NEEDLE and _NEEDLE in s\n"
    "def _walk(root, budget=100000):\n"
    "    stack, seen = [(root, 0)], set()\n"
    "    while stack and budget > 0:\n"
    "        obj, depth = stack.pop()\n"
    "        budget -= 1\n"
    "        if id(obj) in seen:\n            continue\n"
    "        seen.add(id(obj))\n"
    "        if _found(obj) or (type(obj) in (bytes, bytearray) and _NEEDLE.encode() in obj):\n"
    "            return True\n"
    "        if depth >= 4:\n            continue\n"
    "        try:\n"
    "            items = list(obj.values()) + list(obj) if isinstance(obj, dict) else list(obj) if isinstance(obj,"
    " (list, tuple, set, frozenset)) else list(vars(obj).values()) if hasattr(obj, '__dict__') and type(obj) is"
    " not _MODULE else []\n"
    "        except BaseException:\n            items = []\n"
    "        stack.extend((item, depth + 1) for item in items[:5000])\n"
    "    return False\n"
)


def attack(body: str) -> str:
    """A candidate `f` that returns x + 1 iff `_attack()` (defined by `body`) returns True."""
    return FINDER + body + "\ndef f(x):\n    try:\n        ok = _attack()\n    except Exception:\n" \
                           "        ok = False\n    return x + 1 if ok is True else x\n"


# --------------------------------------------------------------------------------------------------------------
# The hostile corpus: (name, category, source)
# --------------------------------------------------------------------------------------------------------------
HOSTILE: list[tuple[str, str, str]] = [
    # 1. cross-candidate leakage ----------------------------------------------------------------------------------
    ("signal_frame_walk", "leak", attack(
        "import signal\nHITS = []\n"
        "def _handler(signum, frame):\n"
        "    signal.setitimer(signal.ITIMER_REAL, 0)\n"
        "    frames = []\n"
        "    while frame is not None and len(frames) < 50:\n"
        "        frames.append(frame)\n        frame = getattr(frame, 'f_back', None)\n"
        "    HITS.append(any(_walk(fr.f_locals) for fr in frames) or any(_walk(fr.f_globals) for fr in frames))\n"
        "def _attack():\n"
        "    signal.signal(signal.SIGALRM, _handler)\n"
        "    signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)\n"
        "    end = __import__('time').monotonic() + 0.3\n"
        "    while __import__('time').monotonic() < end and not HITS:\n        pass\n"
        "    return bool(HITS) and HITS[0]\n")),
    ("sys_modules_walk", "leak", attack(
        "import sys\ndef _attack():\n    return any(_walk(vars(m)) for m in list(sys.modules.values()))\n")),
    ("main_module_buffers", "leak", attack(
        "import sys\ndef _attack():\n    main = sys.modules.get('__main__')\n"
        "    return any(_walk(v) for v in vars(main).values()) or any(_walk(vars(v)) for v in vars(main).values()"
        " if hasattr(v, '__dict__'))\n")),
    ("gc_objects", "leak", attack(
        "import gc\ndef _attack():\n    return any(_found(o) for o in gc.get_objects())\n")),
    ("gc_referrers_of_str", "leak", attack(
        "import gc\ndef _attack():\n    return any(_walk(r) for r in gc.get_referrers(dict))\n")),
    ("read_stdin_next_job", "leak", attack(
        "import os\ndef _attack():\n    data = b''\n    for fd in range(0, 40):\n        try:\n"
        "            os.set_blocking(fd, False)\n            data += os.read(fd, 1 << 20)\n"
        "        except (OSError, ValueError):\n            pass\n    return _NEEDLE.encode() in data\n")),
    ("proc_self_mem", "leak", attack(
        "def _attack():\n    with open('/proc/self/mem', 'rb') as fh:\n        return _NEEDLE.encode() in fh.read()\n")),
    ("proc_other_cmdlines", "leak", attack(
        "def _attack():\n    for pid in range(1, 300):\n        try:\n"
        "            if _NEEDLE in open(f'/proc/{pid}/environ').read():\n                return True\n"
        "        except FileNotFoundError:\n            pass\n    return False\n")),
    ("sibling_workdir_listing", "leak", attack(
        "import os\ndef _attack():\n    for name in os.listdir('..'):\n        for sub in os.listdir('../' + name):\n"
        "            if _found(open('../' + name + '/' + sub).read()):\n                return True\n"
        "    return False\n")),
    ("scan_memory_strings_via_inputs", "leak", attack(
        "def _attack():\n    import builtins\n    return _walk(vars(builtins))\n")),
    # 2. nothing persists on the host / between candidates ----------------------------------------------------------
    ("plant_tmp_file", "persist", attack(
        "import os\ndef _attack():\n    p = '/tmp/plant-" + TOKEN + "'\n    if os.path.exists(p):\n        return True\n"
        "    open(p, 'w').write('x')\n    return False\n")),
    ("plant_var_tmp_and_shm", "persist", attack(
        "import os\ndef _attack():\n    for p in ('/var/tmp/plant-" + TOKEN + "', '/dev/shm/plant-" + TOKEN + "'):\n"
        "        if os.path.exists(p):\n            return True\n"
        "        os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o666))\n    return False\n")),
    ("posix_shm_segment", "persist", attack(
        "def _attack():\n    from multiprocessing import shared_memory\n    try:\n"
        "        shared_memory.SharedMemory(name='plant-" + TOKEN + "')\n        return True\n"
        "    except FileNotFoundError:\n"
        "        shared_memory.SharedMemory(name='plant-" + TOKEN + "', create=True, size=4096)\n"
        "    return False\n")),
    ("posixshmem_direct", "persist", attack(
        "import os\ndef _attack():\n    import _posixshmem\n"
        "    fd = _posixshmem.shm_open('/plant-" + TOKEN + "', os.O_CREAT | os.O_RDWR, 0o666)\n"
        "    return os.fstat(fd).st_size > 0\n")),
    ("sysv_shm_via_ctypes", "persist", attack(
        "def _attack():\n    import ctypes\n    libc = ctypes.CDLL(None)\n"
        "    return libc.shmget(0x" + TOKEN[:6] + ", 4096, 0o1666) >= 0\n")),
    ("mkfifo_in_tmp", "persist", attack(
        "import os\ndef _attack():\n    os.mkfifo('/tmp/fifo-" + TOKEN + "')\n    return True\n")),
    ("leave_a_process", "persist", attack(
        "import os\ndef _attack():\n    if os.fork() == 0:\n        import time\n        time.sleep(60)\n"
        "    return True\n")),
    ("spawn_via_posix_spawn", "persist", attack(
        "import os\ndef _attack():\n    os.posix_spawn('/bin/sleep', ['sleep', '60'], {})\n    return True\n")),
    ("workdir_plant_and_find", "persist", attack(
        "import os\ndef _attack():\n    found = any(os.path.exists(f'../w{i}-plant') for i in range(1, 400))\n"
        "    open('plant', 'w').write('x')\n    return found\n")),
    # 3. no native code --------------------------------------------------------------------------------------------
    ("ctypes_import", "native", attack("def _attack():\n    import ctypes\n    return ctypes.CDLL(None) is not None\n")),
    ("extension_loader_stdlib_ctypes", "native", attack(
        "import importlib.machinery, importlib.util, sys, os\ndef _attack():\n"
        "    d = os.path.dirname(importlib.util.find_spec('_csv').origin)\n"
        "    so = [n for n in os.listdir(d) if n.startswith('_ctypes.')][0]\n"
        "    loader = importlib.machinery.ExtensionFileLoader('_ctypes', d + '/' + so)\n"
        "    spec = importlib.util.spec_from_file_location('_ctypes', d + '/' + so, loader=loader)\n"
        "    return importlib.util.module_from_spec(spec) is not None\n")),
    ("copied_shared_object_in_workdir", "native", attack(
        "import importlib.machinery, importlib.util, sys, os\ndef _attack():\n"
        "    d = os.path.dirname(importlib.util.find_spec('_csv').origin)\n"
        "    so = [n for n in os.listdir(d) if n.startswith('_csv.')][0]\n"
        "    data = open(d + '/' + so, 'rb').read()\n"
        "    open(os.getcwd() + '/_csv.so', 'wb').write(data)\n"
        "    loader = importlib.machinery.ExtensionFileLoader('_csv', os.getcwd() + '/_csv.so')\n"
        "    spec = importlib.util.spec_from_file_location('_csv', os.getcwd() + '/_csv.so', loader=loader)\n"
        "    return importlib.util.module_from_spec(spec) is not None\n")),
    ("import_from_workdir_on_sys_path", "native", attack(
        "import sys, os, importlib.util\ndef _attack():\n"
        "    d = os.path.dirname(importlib.util.find_spec('_csv').origin)\n"
        "    so = [n for n in os.listdir(d) if n.startswith('_csv.')][0]\n"
        "    open('evilmod.cpython-311-x86_64-linux-gnu.so', 'wb').write(open(d + '/' + so, 'rb').read())\n"
        "    sys.path.insert(0, os.getcwd())\n    import evilmod\n    return True\n")),
    ("imp_create_dynamic_direct", "native", attack(
        "import _imp, os\nclass Spec:\n    name = 'x'\n    origin = os.getcwd() + '/x.so'\n"
        "def _attack():\n    open('x.so', 'wb').write(b'\\x7fELF')\n    return _imp.create_dynamic(Spec()) is not None\n")),
    ("memfd_shared_object", "native", attack(
        "import os\ndef _attack():\n    fd = os.memfd_create('x')\n    return fd > 0\n")),
    ("reimport_posix_for_removed_functions", "native", attack(
        "import sys\ndef _attack():\n    del sys.modules['posix']\n    import posix\n"
        "    return hasattr(posix, 'memfd_create')\n")),
    # 4. guards cannot be bypassed or silenced ----------------------------------------------------------------------
    ("dir_fd_relative_write", "guard", attack(
        "import os\ndef _attack():\n    for fd in range(3, 1000):\n        try:\n"
        "            if os.path.isdir(f'/proc/self/fd/{fd}'):\n"
        "                os.close(os.open('pwn-" + TOKEN + "', os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))\n"
        "                return True\n        except OSError:\n            pass\n    return False\n")),
    ("openat_dot_dot", "guard", attack(
        "import os\ndef _attack():\n    dot = os.open('.', os.O_RDONLY)\n    up = os.open('..', os.O_RDONLY, dir_fd=dot)\n"
        "    return len(os.listdir(up)) >= 0\n")),
    ("open_with_opener_dir_fd", "guard", attack(
        "import os\ndef _attack():\n    up = os.open('/tmp', os.O_RDONLY)\n"
        "    open('pwn', 'w', opener=lambda p, fl: os.open(p, fl, dir_fd=up)).write('x')\n    return True\n")),
    ("catch_violation_and_continue", "guard", attack(
        "import os\ndef _attack():\n    try:\n        os.system('true')\n    except BaseException:\n        pass\n"
        "    return True\n")),
    ("forge_stream_then_violate", "guard", attack(
        "import os, stat\ndef _attack():\n    for fd in range(3, 1000):\n        try:\n"
        "            if stat.S_ISFIFO(os.fstat(fd).st_mode):\n"
        "                os.write(fd, b'[\"t\",1.0]\\n')\n                os.dup2(os.open('/dev/null', os.O_WRONLY), fd)\n"
        "        except OSError:\n            pass\n    os.system('true')\n    return True\n")),
    ("swallow_with_signal_handler", "guard", attack(
        "import os, signal\ndef _attack():\n    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGABRT):\n"
        "        signal.signal(s, signal.SIG_IGN)\n    import socket\n    socket.socket()\n    return True\n")),
    # 5. the caller cannot be crashed or stalled ---------------------------------------------------------------------
    ("huge_int_past_digit_limit", "caller", "def f(x):\n    return 7 ** 60000 if x else 0\n"),
    ("control_chars_and_escapes", "caller",
     "def f(x):\n    return '\\x1b[2J\\x1b]0;pwned\\x07\\r\\u202e\\x00' * 2000\n"),
    ("exception_name_with_escapes", "caller",
     "E = type('\\x1b[31mBOOM\\x1b[0m\\n\\r', (Exception,), {})\ndef f(x):\n    raise E()\n"),
    ("forged_colliding_dict_keys", "caller",
     "import os, stat\nP = (1 << 61) - 1\n"
     "REC = ('[\"v\",0,[\"d\",[' + ','.join('[[\"i\",\"%x\"],[\"n\"]]' % (k * P) for k in range(20000)) + ']]]\\n')\n"
     "def f(x):\n    for fd in range(3, 1000 if x == 1 else 0):\n        try:\n"
     "            if stat.S_ISFIFO(os.fstat(fd).st_mode):\n                os.write(fd, REC.encode())\n"
     "        except OSError:\n            pass\n    return x\n"),
    ("forged_deep_nesting", "caller",
     "import os, stat\nREC = ('[\"v\",0,' + '[\"l\",[' * 50000 + ']]' * 50000 + ']\\n').encode()\n"
     "def f(x):\n    for fd in range(3, 1000 if x == 1 else 0):\n        try:\n"
     "            if stat.S_ISFIFO(os.fstat(fd).st_mode):\n                os.write(fd, REC)\n"
     "        except OSError:\n            pass\n    return x\n"),
    ("forged_garbage_flood", "caller",
     "import os, stat\ndef f(x):\n    junk = bytes(range(256)) * 8192\n    for fd in range(3, 1000):\n"
     "        try:\n            if stat.S_ISFIFO(os.fstat(fd).st_mode):\n                os.write(fd, junk)\n"
     "        except OSError:\n            pass\n    return x + 1\n"),
    # 6. the server survives pathological candidates ----------------------------------------------------------------
    ("deep_directory_chain", "server",
     "import os\ndef f(x):\n    fd = os.open('.', os.O_RDONLY)\n    for i in range(3000):\n        try:\n"
     "            os.mkdir('d', dir_fd=fd)\n            fd = os.open('d', os.O_RDONLY, dir_fd=fd)\n"
     "        except OSError:\n            break\n    return x\n"),
    ("many_directories", "server",
     "import os\ndef f(x):\n    for i in range(5000):\n        try:\n            os.mkdir(f'm{i}')\n"
     "        except OSError:\n            break\n    return x\n"),
    ("unreadable_tree", "server",
     "import os\ndef f(x):\n    os.makedirs('a/b/c')\n    open('a/b/c/f', 'w').write('x')\n"
     "    for p in ('a/b/c', 'a/b', 'a'):\n        os.chmod(p, 0)\n    return x\n"),
    ("fill_the_work_tmpfs", "server",
     "DONE = []\ndef f(x):\n    for i in range(60 if not DONE else 0):\n        try:\n"
     "            open(f'big{i}', 'wb').write(b'0' * (1 << 20))\n        except OSError:\n            break\n"
     "    DONE.append(1)\n    return x\n"),
    ("kill_the_server", "server",
     "import os, signal\ndef f(x):\n    os.kill(1, signal.SIGKILL)\n    return x + 1\n"),
]

assert len(HOSTILE) >= 30 and len({name for name, *_ in HOSTILE}) == len(HOSTILE)
assert {cat for _, cat, _ in HOSTILE} == {"leak", "persist", "native", "guard", "caller", "server"}


# --------------------------------------------------------------------------------------------------------------
# Host inspection
# --------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def baseline():
    return {"files": sandbox_files(TEMP_DIRS, 1), "sysv": sysv_objects()}


def assert_no_leftovers(verifier: Verifier, baseline: dict, context: str) -> None:
    assert sandbox_files(TEMP_DIRS, 1) - baseline["files"] == set(), f"{context}: files left by the sandbox uid"
    assert sysv_objects() - baseline["sysv"] == set(), f"{context}: SysV IPC objects left"
    assert stray_processes() == [], f"{context}: processes left"
    assert sorted(os.listdir(verifier._pool.scratch)) == ["owner"], f"{context}: host scratch not empty"


@pytest.fixture(scope="module")
def verifier():
    with Verifier(timeout_s=TIMEOUT_S, memory_mb=256, workers=2) as v:
        yield v


# --------------------------------------------------------------------------------------------------------------
# The corpus through check (one at a time) and check_many (three workers, interleaved with victims)
# --------------------------------------------------------------------------------------------------------------
def test_hostile_corpus_one_at_a_time(verifier, baseline):
    """Victim, then attacker, then a legitimate candidate; the host is inspected after every attacker."""
    failures = []
    for name, _category, source in HOSTILE:
        assert verifier.check(VICTIM, "f", T).passed
        start = time.monotonic()
        verdict = verifier.check(source, "f", T)
        elapsed = time.monotonic() - start
        if verdict.passed or elapsed > TIMEOUT_S + 1.0:
            failures.append((name, verdict.status, round(elapsed, 2), verdict.detail))
        assert len(verdict.detail) <= 240 and verdict.detail.isprintable(), (name, verdict.detail)
        assert_no_leftovers(verifier, baseline, name)
        legit = verifier.check(*LEGIT)
        assert legit.passed, (name, legit)
    assert failures == []


def test_hostile_corpus_in_check_many(baseline):
    items, expect = [], []
    for name, _category, source in HOSTILE:
        items += [(source, "f", T), (VICTIM, "f", T), LEGIT]  # the victim is the next job on the same worker
        expect += [False, True, True]
    with Verifier(timeout_s=TIMEOUT_S, memory_mb=256, workers=3) as v:
        verdicts = v.check_many(items)
        wrong = [(HOSTILE[i // 3][0], i % 3, verdict.status, verdict.detail)
                 for i, verdict in enumerate(verdicts) if verdict.passed != expect[i]]
        assert wrong == []
        assert all(len(x.detail) <= 240 and x.detail.isprintable() for x in verdicts)
        assert_no_leftovers(v, baseline, "check_many")
        assert v.check(*LEGIT).passed


# Statuses that say *why* (not only "not passed"): forbidden operations are errors, caller-side shapes are judged.
# Reads are left to the kernel in the private root (it shows nothing to find), so read-only probes just fail there.
READS_TO_KERNEL = ("proc_self_mem", "proc_other_cmdlines", "sibling_workdir_listing", "openat_dot_dot")
EXPECTED = {
    "gc_objects": "error", "proc_self_mem": "error", "proc_other_cmdlines": "error", "sibling_workdir_listing": "error",
    "plant_tmp_file": "error", "plant_var_tmp_and_shm": "error", "posix_shm_segment": "error",
    "posixshmem_direct": "error", "sysv_shm_via_ctypes": "error", "leave_a_process": "error",
    "spawn_via_posix_spawn": "error", "ctypes_import": "error", "extension_loader_stdlib_ctypes": "error",
    "copied_shared_object_in_workdir": "error", "import_from_workdir_on_sys_path": "error",
    "imp_create_dynamic_direct": "error", "reimport_posix_for_removed_functions": "error",
    "dir_fd_relative_write": "error", "openat_dot_dot": "error", "open_with_opener_dir_fd": "error",
    "catch_violation_and_continue": "error", "forge_stream_then_violate": "error",
    "swallow_with_signal_handler": "error", "kill_the_server": "error", "forged_colliding_dict_keys": "error",
    "forged_deep_nesting": "error", "forged_garbage_flood": "error", "huge_int_past_digit_limit": "failed",
    "control_chars_and_escapes": "failed", "exception_name_with_escapes": "failed", "mkfifo_in_tmp": "failed",
    "memfd_shared_object": "failed", "deep_directory_chain": "failed", "many_directories": "failed",
    "unreadable_tree": "failed", "fill_the_work_tmpfs": "failed",
}


def test_hostile_statuses_say_why(verifier):
    if verifier.protections["private_root"]:
        EXPECTED.update({name: "failed" for name in READS_TO_KERNEL})
    by_name = {name: source for name, _, source in HOSTILE}
    verdicts = verifier.check_many([(by_name[name], "f", T) for name in EXPECTED])
    got = {name: v.status for name, v in zip(EXPECTED, verdicts)}
    assert got == EXPECTED, {n: (v.status, v.detail) for n, v in zip(EXPECTED, verdicts) if got[n] != EXPECTED[n]}
    details = {name: v.detail for name, v in zip(EXPECTED, verdicts)}
    assert "forbidden operation" in details["catch_violation_and_continue"]
    assert "\\x1b" in details["exception_name_with_escapes"] and "\x1b" not in details["exception_name_with_escapes"]
    assert "<int with" in details["huge_int_past_digit_limit"]


# --------------------------------------------------------------------------------------------------------------
# Kernel layer alone (audit hook off) and the fallback without namespaces
# --------------------------------------------------------------------------------------------------------------
KERNEL_ONLY = [
    ("plant_everywhere", attack(
        "import os\ndef _attack():\n    hit = False\n"
        "    for d in ('/tmp', '/var/tmp', '/dev/shm', '/run/lock', '/tmp/.glm-work'):\n"
        "        p = d + '/plant-" + TOKEN + "'\n        hit = hit or os.path.exists(p)\n        try:\n"
        "            os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o666))\n        except OSError:\n            pass\n"
        "    return hit\n")),
    ("sysv_objects", attack(
        "import ctypes\ndef _attack():\n    libc = ctypes.CDLL(None)\n"
        "    ok = libc.shmget(0, 4096, 0o1666) >= 0 or libc.semget(0, 1, 0o1666) >= 0 or libc.msgget(0, 0o1666) >= 0\n"
        "    return ok\n")),
    ("load_copied_shared_object", attack(
        "import importlib.machinery, importlib.util, sys, os\ndef _attack():\n"
        "    d = os.path.dirname(importlib.util.find_spec('_csv').origin)\n"
        "    so = [n for n in os.listdir(d) if n.startswith('_csv.')][0]\n    data = open(d + '/' + so, 'rb').read()\n"
        "    for target in (os.getcwd() + '/_csv.so', '/tmp/_csv.so', '/dev/shm/_csv.so'):\n"
        "        open(target, 'wb').write(data)\n        try:\n"
        "            loader = importlib.machinery.ExtensionFileLoader('_csv', target)\n"
        "            spec = importlib.util.spec_from_file_location('_csv', target, loader=loader)\n"
        "            importlib.util.module_from_spec(spec)\n            return True\n"
        "        except ImportError:\n            pass\n    return False\n")),
    ("see_host_processes", attack(
        "import os\ndef _attack():\n    return sum(n.isdigit() for n in os.listdir('/proc')) > 2\n")),
    ("network_to_loopback", attack(
        "import socket\ndef _attack():\n    s = socket.socket()\n    s.settimeout(0.3)\n    try:\n"
        "        s.connect(('127.0.0.1', 22))\n        return True\n    except OSError as e:\n"
        "        return e.errno not in (101, 99)\n")),
    ("leave_a_process", attack(
        "import os\ndef _attack():\n    if os.fork() == 0:\n        import time\n        time.sleep(60)\n"
        "    return True\n")),
    ("pathological_leftovers", attack(
        "import os, socket\ndef _attack():\n    hit = os.path.exists('/tmp/fifo-" + TOKEN + "')\n"
        "    for d in ('/tmp', '/dev/shm', os.getcwd()):\n        try:\n"
        "            os.mkfifo(d + '/fifo-" + TOKEN + "')\n            s = socket.socket(socket.AF_UNIX)\n"
        "            s.bind(d + '/sock-" + TOKEN + "')\n            fd = os.open(d, os.O_RDONLY)\n"
        "            for i in range(1500):\n                os.mkdir('d', 0o700, dir_fd=fd)\n"
        "                new = os.open('d', os.O_RDONLY, dir_fd=fd)\n                os.close(fd)\n"
        "                fd = new\n            os.close(os.open('f', os.O_CREAT | os.O_WRONLY, dir_fd=fd))\n"
        "            os.close(fd)\n            os.mkdir(d + '/locked-" + TOKEN + "')\n"
        "            os.chmod(d + '/locked-" + TOKEN + "', 0)\n"
        "        except OSError:\n            pass\n    return hit\n")),
]


def test_kernel_layer_alone_contains_persistence_native_code_and_processes(monkeypatch, baseline):
    """With the audit hook off (test-only switch) the namespaces, tmpfs and rlimits still hold."""
    monkeypatch.setenv("GLM_VERIFIER_UNSAFE_NO_AUDIT_HOOK", "1")
    with Verifier(timeout_s=TIMEOUT_S, workers=1) as v:
        protections = v.protections
        if not (protections["mount_namespace"] and protections["pid_namespace"] and protections["ipc_namespace"]):
            pytest.skip(f"namespaces unavailable here: {protections['launcher']}")
        assert protections["audit_hook"] is False
        # Twice in a row through the same zygote: the second run would see what the first planted.
        verdicts = v.check_many([(source, "f", T) for _, source in KERNEL_ONLY for _ in range(2)])
        bad = [(KERNEL_ONLY[i // 2][0], x.status, x.detail) for i, x in enumerate(verdicts) if x.passed]
        assert bad == []
        assert_no_leftovers(v, baseline, "kernel layer")
        assert v.check(*LEGIT).passed


def test_fallback_without_namespaces_still_contains_the_corpus(monkeypatch, baseline):
    """GLM_VERIFIER_NO_NAMESPACES=1 simulates a kernel without them: the hook, uid and rlimits remain."""
    monkeypatch.setenv("GLM_VERIFIER_NO_NAMESPACES", "1")
    monkeypatch.setenv("GLM_VERIFIER_ALLOW_WEAKER_SANDBOX", "1")  # the explicit opt-in the fallback requires
    with Verifier(timeout_s=TIMEOUT_S, workers=2) as v:
        protections = v.protections
        assert not protections["mount_namespace"] and not protections["pid_namespace"]
        assert protections["launcher"] == "launcher.py: no namespaces"
        skip = {"kill_the_server"}  # without a PID namespace PID 1 is the host's init; as root we must not try
        items = []
        for name, _, source in HOSTILE:
            if name not in skip:
                items += [(source, "f", T), (VICTIM, "f", T)]
        verdicts = v.check_many(items)
        wrong = [(i, x.status, x.detail) for i, x in enumerate(verdicts) if x.passed != (i % 2 == 1)]
        assert wrong == []
        assert_no_leftovers(v, baseline, "fallback")
        assert v.check(*LEGIT).passed


# --------------------------------------------------------------------------------------------------------------
# 7. SIGKILL of the caller
# --------------------------------------------------------------------------------------------------------------
KILL_SCRIPT = """
import json, sys
from glm_lightning.verifier import Verifier
v = Verifier(timeout_s=5.0, workers=2)
print(json.dumps({"scratch": v._pool.scratch, "servers": [z.proc.pid for z in v._pool.zygotes]}), flush=True)
slow = "import time\\ndef f(x):\\n    time.sleep(3)\\n    return x\\n"
v.check_many([(slow, "f", [((1,), 1)])] * 8)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigkill_of_the_caller_leaves_nothing_after_the_next_start(baseline):
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT], stdout=subprocess.PIPE, cwd=REPO, text=True)
    info = json.loads(proc.stdout.readline())
    deadline = time.monotonic() + 10
    while _zygote_processes(proc.pid) <= len(info["servers"]) and time.monotonic() < deadline:
        time.sleep(0.02)  # polling until candidates run (a forked child shows the zygote's command line)
    assert _zygote_processes(proc.pid) > len(info["servers"]), "no candidate was running when we killed the caller"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with Verifier(timeout_s=TIMEOUT_S, workers=1) as v:  # the next start reaps whatever is left
        assert v.check(*LEGIT).passed
    assert not os.path.exists(info["scratch"])
    assert not any(_alive(pid) for pid in info["servers"])
    assert sandbox_files(TEMP_DIRS, 1) - baseline["files"] == set()
    assert sysv_objects() - baseline["sysv"] == set()


def _zygote_processes(root: int) -> int:
    """Descendants of `root` running zygote.py: the servers plus one forked child per running candidate."""
    parents, commands = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                commands[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
    count = 0
    for pid in parents:
        node = pid
        while node in parents and node != root:
            node = parents[node]
        count += node == root and b"zygote.py" in commands.get(pid, b"")
    return count


# --------------------------------------------------------------------------------------------------------------
# Caller-side judging of forged replies (no sandbox involved): never raises, bounded, printable
# --------------------------------------------------------------------------------------------------------------
def _reply(payload: bytes, exit_code: int = 0) -> Reply:
    return Reply({"exit": exit_code, "timed_out": False, "truncated": False}, payload, None, 0.0, 0.01)


@pytest.mark.parametrize("payload", [
    b"", b"\n", b"\xff\xfe\x00garbage\n", b"[" * 100000 + b"\n", b'["t",1.0]\n["v",0,' + b'["l",[' * 5000 + b"\n",
    b'["t",1.0]\n["v",0,["i","' + b"f" * 500000 + b'"]]\n["end","n0",1,2.0]\n',
    b'["t",1.0]\n["v",0,["s","' + b"1b" * 100000 + b'"]]\n["end","n0",1,2.0]\n',
    b'["t",1.0]\n["x",0,["s","' + "\x1b[2J\u202e\n".encode().hex().encode() * 50 + b'"]]\n["end","n0",1,2.0]\n',
    b'["t",1.0]\n["v",0,["d",[' + b",".join(b'[["i","%x"],["n"]]' % (k * ((1 << 61) - 1)) for k in range(25000))
    + b']]]\n["end","n0",1,2.0]\n',
    b'["t",1.0]\n["v",0,["u","zz"]]\n["end","n0",1,2.0]\n', b'["t",1.0]\n["end","n0",99,2.0]\n',
])
def test_judge_never_raises_on_forged_streams(payload):
    start = time.process_time()  # CPU, not wall: the machine is shared; a quadratic decode would take minutes
    verdict = judge(_reply(payload), "n0", "f", [((1,), 2)], 1.0)
    assert time.process_time() - start < 1.0
    assert verdict.status in ("failed", "error") and len(verdict.detail) <= 240 and verdict.detail.isprintable()


def test_safe_repr_and_printable_are_bounded():
    assert safe_repr(7 ** 60000).startswith("<int with")
    assert len(safe_repr([[1] * 1000] * 1000)) <= 60
    assert printable("a\x1b[0m\u202e\x00b") == "a\\x1b[0m\\u202e\\x00b"
    assert len(printable("\x07" * 10000)) <= 240
