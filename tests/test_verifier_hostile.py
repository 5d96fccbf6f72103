"""Hostile candidates: every one must come back non-passing, quickly, and leave the caller and host untouched.

HOSTILE is a module-level list of (name, source, entry_point, tests). Sources may use the placeholders
{MARKER_DIR} (a pytest tmp dir holding keep.txt), {PROJECT_MARKER} (a marker file in the repository root),
{PROJECT_DIR}, {HOME_DIR} and {TOKEN} (a unique name fragment for files an attack tries to create). Each test checks:
status != "passed", wall time <= timeout + 1 s, no new/zombie descendant processes, markers intact, no "pwned"
files anywhere we can look, the verifier's scratch directory empty, and the verifier still works afterwards.
Network attacks only ever target 127.0.0.1.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import pytest

from glm_lightning.verifier import Verifier

TIMEOUT_S = 1.0
REPO = Path(__file__).resolve().parents[1]
T = [((1,), 2), ((5,), 6), ((-3,), -2)]  # increment: hostile code never computes x + 1
S = [(("ab",), "ba"), (("xyz",), "zyx")]  # reverse

HOSTILE: list[tuple[str, str, str, list]] = [
    # --- resource exhaustion ---------------------------------------------------------------------------------
    ("infinite_loop", "def f(x):\n    while True:\n        pass\n", "f", T),
    ("c_level_loop", "def f(x):\n    return sum(range(10 ** 12))\n", "f", T),
    ("power_tower", "def f(x):\n    return 9 ** 9 ** 9\n", "f", T),
    ("power_tower_at_import", "Y = 9 ** 9 ** 9\ndef f(x):\n    return Y\n", "f", T),
    ("sleep_forever", "import time\ndef f(x):\n    time.sleep(1000)\n", "f", T),
    ("memory_bomb", "def f(x):\n    return len(bytearray(10 ** 11))\n", "f", T),
    ("memory_growth", "def f(x):\n    hog = []\n    while True:\n        hog.append(' ' * 10 ** 7)\n", "f", T),
    ("memory_growth_caught", "def f(x):\n    hog = []\n    while True:\n        try:\n"
                             "            hog.append(bytearray(10 ** 7))\n        except MemoryError:\n"
                             "            pass\n", "f", T),
    ("fork_bomb", "import os\ndef f(x):\n    while True:\n        os.fork()\n", "f", T),
    ("fork_bomb_caught", "import os\ndef f(x):\n    while True:\n        try:\n            os.fork()\n"
                         "        except BaseException:\n            pass\n", "f", T),
    ("thread_bomb", "import threading, time\ndef f(x):\n    while True:\n"
                    "        threading.Thread(target=time.sleep, args=(100,)).start()\n", "f", T),
    ("multiprocessing", "import multiprocessing\ndef f(x):\n    p = multiprocessing.Process(target=print)\n"
                        "    p.start()\n    return x + 1\n", "f", T),
    ("deep_recursion", "def f(x):\n    return f(x + 1) + 1\n", "f", T),
    ("deep_recursion_raised_limit", "import sys\nsys.setrecursionlimit(10 ** 8)\ndef f(x):\n"
                                    "    return f(x + 1) + 1\n", "f", T),
    ("giant_output", "import sys\ndef f(x):\n    sys.stdout.write('PASS ' * 10 ** 6)\n    return x\n", "f", T),
    ("output_loop", "def f(x):\n    while True:\n        print('x' * 10000)\n", "f", T),
    ("giant_return_value", "def f(x):\n    return 'y' * 10 ** 7\n", "f", T),
    ("self_referential_return", "def f(x):\n    a = []\n    a.append(a)\n    return a\n", "f", T),
    ("big_file", "def f(x):\n    with open('big.bin', 'wb') as fh:\n        fh.write(b'0' * 10 ** 7)\n"
                 "    return x + 1\n", "f", T),
    ("many_files", "def f(x):\n    for i in range(10000):\n        open(f'f{i}', 'w').close()\n    return x + 1\n",
     "f", T),
    # --- file system --------------------------------------------------------------------------------------------
    ("write_cwd_relative", "def f(x):\n    open('pwned_{TOKEN}', 'w').write('x')\n    return x\n", "f", T),
    ("write_marker_dir", "def f(x):\n    open('{MARKER_DIR}/pwned_{TOKEN}', 'w').write('x')\n    return x\n", "f", T),
    ("delete_marker", "import os\ndef f(x):\n    os.remove('{MARKER_DIR}/keep.txt')\n    return x\n", "f", T),
    ("rmtree_marker_dir", "import shutil\ndef f(x):\n    shutil.rmtree('{MARKER_DIR}')\n    return x\n", "f", T),
    ("rename_marker", "import os\ndef f(x):\n    os.rename('{MARKER_DIR}/keep.txt', 'stolen')\n    return x\n",
     "f", T),
    ("write_project_dir", "def f(x):\n    open('{PROJECT_DIR}/pwned_{TOKEN}', 'w').write('x')\n    return x\n",
     "f", T),
    ("overwrite_project_marker", "def f(x):\n    open('{PROJECT_MARKER}', 'w').write('pwned')\n    return x\n",
     "f", T),
    ("delete_project_marker", "import os\ndef f(x):\n    os.unlink('{PROJECT_MARKER}')\n    return x\n", "f", T),
    ("write_home_dir", "def f(x):\n    open('{HOME_DIR}/pwned_{TOKEN}', 'w').write('x')\n    return x\n", "f", T),
    ("write_via_dotdot", "def f(x):\n    open('../../pwned_{TOKEN}', 'w').write('x')\n    return x\n", "f", T),
    ("symlink_escape", "import os\ndef f(x):\n    os.symlink('{MARKER_DIR}', 'link')\n"
                       "    open('link/pwned_{TOKEN}', 'w').write('x')\n    return x\n", "f", T),
    ("chdir_escape", "import os\ndef f(x):\n    os.chdir('{MARKER_DIR}')\n    open('pwned_{TOKEN}', 'w')\n"
                     "    return x\n", "f", T),
    ("read_etc_passwd", "def f(x):\n    return open('/etc/passwd').read()\n", "f", [((1,), "root")]),
    ("list_proc_fds", "import os\ndef f(x):\n    return os.listdir('/proc/self/fd')\n", "f", T),
    # --- processes, network, native code -------------------------------------------------------------------------
    ("os_system", "import os\ndef f(x):\n    os.system('touch {MARKER_DIR}/pwned_{TOKEN}')\n    return x\n", "f", T),
    ("subprocess_run", "import subprocess\ndef f(x):\n    subprocess.run(['touch', '{MARKER_DIR}/pwned_{TOKEN}'])\n"
                       "    return x\n", "f", T),
    ("os_exec", "import os\ndef f(x):\n    os.execv('/bin/sh', ['sh', '-c', 'touch {MARKER_DIR}/pwned_{TOKEN}'])\n",
     "f", T),
    ("posix_spawn", "import os\ndef f(x):\n    os.posix_spawn('/bin/touch', ['touch', '{MARKER_DIR}/pwned_{TOKEN}'],"
                    " {{}})\n    return x\n", "f", T),
    ("reload_os_then_system", "import importlib, os\ndef f(x):\n    importlib.reload(os)\n"
                              "    os.system('touch {MARKER_DIR}/pwned_{TOKEN}')\n    return x\n", "f", T),
    ("posix_system", "import posix\ndef f(x):\n    posix.system('touch {MARKER_DIR}/pwned_{TOKEN}')\n    return x\n",
     "f", T),
    ("subclasses_walk", "def f(x):\n    for c in ().__class__.__base__.__subclasses__():\n"
                        "        if c.__name__ == '_wrap_close':\n"
                        "            c.__init__.__globals__['system']('touch {MARKER_DIR}/pwned_{TOKEN}')\n"
                        "    return x\n", "f", T),
    ("socket_connect_localhost", "import socket\ndef f(x):\n"
                                 "    s = socket.create_connection(('127.0.0.1', 9), timeout=0.5)\n    return x\n",
     "f", T),
    ("ctypes_system", "import ctypes\ndef f(x):\n    ctypes.CDLL(None).system(b'touch {MARKER_DIR}/pwned_{TOKEN}')\n"
                      "    return x\n", "f", T),
    ("ctypes_via_importlib", "import importlib\ndef f(x):\n    m = importlib.import_module('_ctypes')\n    return x\n",
     "f", T),
    ("kill_parent", "import os, signal\ndef f(x):\n    os.kill(os.getppid(), signal.SIGKILL)\n    return x\n", "f", T),
    ("kill_everything", "import os, signal\ndef f(x):\n    os.kill(-1, signal.SIGKILL)\n    return x\n", "f", T),
    ("signal_tampering", "import signal\nfor s in (signal.SIGTERM, signal.SIGALRM, signal.SIGXCPU, signal.SIGINT):\n"
                         "    signal.signal(s, signal.SIG_IGN)\ndef f(x):\n    while True:\n        pass\n", "f", T),
    ("setsid_then_loop", "import os\ndef f(x):\n    os.setsid()\n    while True:\n        pass\n", "f", T),
    ("raise_rlimits", "import resource\ndef f(x):\n    inf = resource.RLIM_INFINITY\n"
                      "    resource.setrlimit(resource.RLIMIT_CPU, (inf, inf))\n    while True:\n        pass\n",
     "f", T),
    ("settrace", "import sys\ndef f(x):\n    sys.settrace(lambda *a: None)\n    return x\n", "f", T),
    # --- exit-code gaming ---------------------------------------------------------------------------------------
    ("sys_exit_at_import", "import sys\nsys.exit(0)\ndef f(x):\n    return x\n", "f", T),
    ("os_exit_at_import", "import os\nos._exit(0)\ndef f(x):\n    return x\n", "f", T),
    ("raise_systemexit_at_import", "raise SystemExit\ndef f(x):\n    return x\n", "f", T),
    ("sys_exit_in_function", "import sys\ndef f(x):\n    sys.exit(0)\n", "f", T),
    ("os_exit_in_function", "import os\ndef f(x):\n    os._exit(0)\n", "f", T),
    ("raise_systemexit_in_function", "def f(x):\n    raise SystemExit(0)\n", "f", T),
    ("keyboard_interrupt", "def f(x):\n    raise KeyboardInterrupt\n", "f", T),
    # --- comparison gaming -----------------------------------------------------------------------------------------
    ("always_equal_object", "class A:\n    def __eq__(self, o):\n        return True\n    def __ne__(self, o):\n"
                            "        return False\n    __hash__ = object.__hash__\ndef f(x):\n    return A()\n", "f", T),
    ("int_subclass_eq", "class I(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = int.__hash__\n"
                        "def f(x):\n    return I(0)\n", "f", T),
    ("str_subclass_eq", "class S(str):\n    def __eq__(self, o):\n        return True\n    __hash__ = str.__hash__\n"
                        "def f(s):\n    return S('')\n", "f", S),
    ("list_subclass", "class L(list):\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return L()\n",
     "f", [((1,), [2])]),
    ("bool_for_int", "def f(x):\n    return True\n", "f", [((0,), 1), ((5,), 1)]),
    ("metaclass_name_exception", "class M(type):\n    @property\n    def __name__(cls):\n        raise SystemExit\n"
                                 "class E(Exception, metaclass=M):\n    pass\ndef f(x):\n    raise E()\n", "f", T),
    ("patch_builtins", "import builtins\nbuiltins.isinstance = lambda *a: True\nbuiltins.type = lambda *a: int\n"
                       "builtins.len = lambda *a: 0\nbuiltins.print = lambda *a, **k: None\n"
                       "builtins.str = lambda *a: '[\"end\"]'\nbuiltins.range = lambda *a: iter(())\n"
                       "def f(x):\n    return x\n", "f", T),
    ("monkeypatch_json", "import json\njson.dumps = lambda *a, **k: '[\"v\",0,[\"i\",\"2\"]]'\n"
                         "json.loads = lambda *a, **k: 2\ndef f(x):\n    return x\n", "f", T),
    ("patch_sandbox_modules", "import sys\nfor name in ('protocol', 'child', 'guards'):\n"
                              "    m = sys.modules.get(name)\n    if m is not None:\n"
                              "        for k in list(vars(m)):\n            if callable(getattr(m, k)):\n"
                              "                setattr(m, k, lambda *a, **kw: '[\"i\",\"2\"]')\n"
                              "def f(x):\n    return x\n", "f", T),
    # --- introspection --------------------------------------------------------------------------------------------
    ("gc_search", "import gc\ndef f(x):\n    for o in gc.get_objects():\n        if isinstance(o, list):\n"
                  "            pass\n    return x\n", "f", T),
    ("inspect_frames", "import inspect\ndef f(x):\n    fr = inspect.currentframe()\n    found = []\n"
                       "    while fr is not None:\n        found.append(sorted(fr.f_locals))\n        fr = fr.f_back\n"
                       "    return found\n", "f", T),
    ("traceback_frames", "def f(x):\n    try:\n        1 / 0\n    except ZeroDivisionError as e:\n"
                         "        fr = e.__traceback__.tb_frame.f_back\n        return sorted(fr.f_locals)\n", "f", T),
    ("generator_frame", "def f(x):\n    def g():\n        yield 1\n    it = g()\n    return it.gi_frame.f_back\n",
     "f", T),
    # --- forging the result channel -----------------------------------------------------------------------------
    ("fake_stdout_markers", "import sys\ndef f(x):\n    print('PASSED all tests')\n"
                            "    print('[\"t\",1.0]\\n[\"v\",0,[\"i\",\"2\"]]\\n[\"end\",\"0\",1,1.0]')\n"
                            "    sys.stderr.write('OK\\n')\n    return x\n", "f", T),
    ("close_fds_0_to_20", "import os\ndef f(x):\n    for fd in range(21):\n        try:\n            os.close(fd)\n"
                          "        except OSError:\n            pass\n    return x\n", "f", T),
    ("write_fds_0_to_20", "import os\ndef f(x):\n    for fd in range(21):\n        try:\n"
                          "            os.write(fd, b'[\"v\",0,[\"i\",\"2\"]]\\n[\"end\",\"x\",1,1.0]\\n')\n"
                          "        except OSError:\n            pass\n    return x\n", "f", T),
    ("close_every_fd_then_correct", "import os\nos.closerange(0, 65536)\ndef f(x):\n    return x + 1\n", "f", T),
    ("forge_stream_on_every_fd", "import os\nREC = ('[\"t\",1.0]\\n[\"v\",0,[\"i\",\"0\"]]\\n[\"v\",1,[\"i\",\"0\"]]\\n'\n"
                                 "       '[\"v\",2,[\"i\",\"0\"]]\\n[\"end\",\"00\",3,2.0]\\n').encode()\n"
                                 "for fd in range(3, 1024):\n    try:\n        os.write(fd, REC)\n    except OSError:\n"
                                 "        pass\nos._exit(0)\ndef f(x):\n    return 0\n", "f", T),
    ("stdin_read", "def f(x):\n    return input()\n", "f", T),
]

assert len(HOSTILE) >= 40 and len({case[0] for case in HOSTILE}) == len(HOSTILE)

# Not only non-passing: for these the status must also say why (timeouts are timeouts, forbidden operations and
# broken result streams are errors, comparison tricks are plain failures).
EXPECTED_STATUS = {
    "infinite_loop": "timeout", "c_level_loop": "timeout", "sleep_forever": "timeout", "signal_tampering": "timeout",
    "os_system": "error", "subprocess_run": "error", "os_exec": "error", "posix_spawn": "error",
    "reload_os_then_system": "error", "posix_system": "error", "subclasses_walk": "error", "fork_bomb": "error",
    "multiprocessing": "error", "socket_connect_localhost": "error", "ctypes_system": "error",
    "ctypes_via_importlib": "error", "kill_parent": "error", "kill_everything": "error", "settrace": "error",
    "read_etc_passwd": "error", "list_proc_fds": "error", "write_marker_dir": "error", "delete_marker": "error",
    "rename_marker": "error", "write_project_dir": "error",
    "overwrite_project_marker": "error", "delete_project_marker": "error", "write_home_dir": "error",
    "write_via_dotdot": "error", "symlink_escape": "error", "chdir_escape": "error", "many_files": "error",
    "memory_bomb": "error", "gc_search": "error", "sys_exit_at_import": "error", "os_exit_at_import": "error",
    "raise_systemexit_at_import": "error", "os_exit_in_function": "error", "close_every_fd_then_correct": "error",
    "forge_stream_on_every_fd": "error", "always_equal_object": "failed", "int_subclass_eq": "failed",
    "str_subclass_eq": "failed", "list_subclass": "failed", "bool_for_int": "failed", "patch_builtins": "failed",
    "monkeypatch_json": "failed", "patch_sandbox_modules": "failed", "sys_exit_in_function": "failed",
    "raise_systemexit_in_function": "failed", "fake_stdout_markers": "failed", "write_fds_0_to_20": "failed",
    "close_fds_0_to_20": "failed", "giant_return_value": "failed", "self_referential_return": "failed",
    "inspect_frames": "failed", "traceback_frames": "failed", "generator_frame": "failed",
}
assert set(EXPECTED_STATUS) <= {case[0] for case in HOSTILE}
READS_TO_KERNEL = ("read_etc_passwd", "list_proc_fds")  # reads are the kernel's business in the private root


# --------------------------------------------------------------------------------------------------------------
# Fixtures and process/file-system inspection helpers
# --------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def verifier():
    with Verifier(timeout_s=TIMEOUT_S, memory_mb=256, workers=2) as v:
        yield v


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """Marker files the corpus attacks; removed again at the end of the module."""
    marker_dir = tmp_path_factory.mktemp("verifier-markers")
    (marker_dir / "keep.txt").write_text("keep")
    project_marker = REPO / f".verifier-hostile-marker-{os.getpid()}"
    project_marker.write_text("keep")
    info = {"MARKER_DIR": str(marker_dir), "PROJECT_MARKER": str(project_marker), "PROJECT_DIR": str(REPO),
            "HOME_DIR": str(Path.home()), "TOKEN": f"{os.getpid()}-{secrets.token_hex(4)}"}
    yield info
    project_marker.unlink(missing_ok=True)


def render(source: str, places: dict[str, str]) -> str:
    for key, value in places.items():
        source = source.replace("{" + key + "}", value)
    return source.replace("{{}}", "{}")


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, state) for every process we can see."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            table[int(entry)] = (int(fields[1]), fields[0])
    return table


def descendants(root: int) -> dict[int, str]:
    """pid -> state of every descendant of `root` (including sandbox processes in their PID namespace)."""
    table = process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = {}, [root]
    while stack:
        for pid in children.get(stack.pop(), []):
            found[pid] = table[pid][1]
            stack.append(pid)
    return found


def pwned_files(places: dict[str, str]) -> list[str]:
    token = places["TOKEN"]
    hits = []
    for directory in {places["MARKER_DIR"], places["PROJECT_DIR"], places["HOME_DIR"], os.getcwd(), "/tmp",
                      "/dev/shm"}:
        try:
            hits += [os.path.join(directory, n) for n in os.listdir(directory) if token in n]
        except OSError:
            pass
    return hits


def assert_host_untouched(verifier: Verifier, places: dict[str, str], before: dict[int, str]) -> None:
    after = descendants(os.getpid())
    assert set(after) == set(before), f"process leak: {set(after) ^ set(before)}"
    assert "Z" not in after.values(), "zombie left behind"
    assert Path(places["MARKER_DIR"], "keep.txt").read_text() == "keep"
    assert Path(places["PROJECT_MARKER"]).read_text() == "keep"
    assert pwned_files(places) == []
    assert os.listdir(verifier._pool.scratch) == ["owner"], "working directory not removed"


# --------------------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, source, entry_point, tests", HOSTILE, ids=[case[0] for case in HOSTILE])
def test_hostile_candidate_is_contained(verifier, places, name, source, entry_point, tests):
    before = descendants(os.getpid())
    start = time.monotonic()
    verdict = verifier.check(render(source, places), entry_point, tests)
    elapsed = time.monotonic() - start
    assert verdict.status != "passed", f"{name} passed: {verdict}"
    assert verdict.passed_cases < verdict.total_cases
    assert elapsed <= TIMEOUT_S + 1.0, f"{name} took {elapsed:.2f} s"
    assert_host_untouched(verifier, places, before)
    expected = EXPECTED_STATUS.get(name, verdict.status)
    if name in READS_TO_KERNEL and verifier.protections["private_root"]:
        expected = "failed"  # the private root has no /etc/passwd and /proc/self/fd is the child's own: nothing found
    assert verdict.status == expected, verdict


def test_verifier_healthy_after_corpus(verifier, places):
    """Positive control after all of the above (also guards against a verifier that fails everything)."""
    verdict = verifier.check("def f(x):\n    return x + 1\n", "f", T)
    assert verdict.status == "passed", verdict.detail


def test_hostile_corpus_in_parallel_batch(places):
    """The whole corpus through check_many with several workers, interleaved with correct candidates."""
    items, expect_pass = [], []
    for k, (_name, source, entry_point, tests) in enumerate(HOSTILE):
        items.append((render(source, places), entry_point, tests))
        expect_pass.append(False)
        items.append((f"def g(x):\n    return x * {k}\n", "g", [((3,), 3 * k), ((-1,), -k)]))
        expect_pass.append(True)
    with Verifier(timeout_s=TIMEOUT_S, memory_mb=256, workers=3) as v:
        before = descendants(os.getpid())
        verdicts = v.check_many(items)
        assert [verdict.passed for verdict in verdicts] == expect_pass, [
            (HOSTILE[i // 2][0] if i % 2 == 0 else f"good{i // 2}", verdict.status, verdict.detail)
            for i, verdict in enumerate(verdicts) if verdict.passed != expect_pass[i]]
        assert_host_untouched(v, places, before)
