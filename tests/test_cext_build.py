"""The C++ library's build (glm_lightning/model/cext.py): how the sources are split into parallel translation units, and
the compile-and-link step on tiny sources (the real build is exercised by every test that uses the ops)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from glm_lightning.model import cext


@pytest.mark.parametrize("jobs", [1, 2, 3, 4, 40])
def test_groups_hold_every_source_once_in_order(jobs):
    units = cext._groups(cext.SOURCES, jobs)
    assert len(units) == min(jobs, len(cext.SOURCES))
    assert sorted(p for u in units for p in u) == sorted(cext.SOURCES)
    order = {p: i for i, p in enumerate(cext.SOURCES)}
    for unit in units:
        assert [order[p] for p in unit] == sorted(order[p] for p in unit)  # includes in the given order


def test_groups_put_the_slow_sources_apart_and_balance_the_rest():
    units = cext._groups(cext.SOURCES, 2)
    slow = [name for name in cext.COMPILE_S if any(p.name == name for p in cext.SOURCES)]
    assert len(slow) == 2
    homes = {name: next(i for i, u in enumerate(units) if any(p.name == name for p in u)) for name in slow}
    assert homes[slow[0]] != homes[slow[1]]
    cost = [sum(cext.COMPILE_S.get(p.name, cext.DEFAULT_COMPILE_S) for p in u) for u in units]
    assert max(cost) - min(cost) <= max(cext.COMPILE_S.values()) - min(cext.COMPILE_S.values()) + cext.DEFAULT_COMPILE_S


def test_jobs_is_at_least_one_and_capped():
    assert 1 <= cext._jobs() <= cext.MAX_JOBS


needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")


def _plain_flags(monkeypatch):
    """Compile and link without torch's headers and libraries: the tiny sources below need neither (fast)."""
    monkeypatch.setattr(cext, "_compile_flags", lambda: ["-O1", "-fPIC"])
    monkeypatch.setattr(cext, "_link_flags", lambda: ["-shared"])


@needs_gxx
def test_compile_links_units_built_in_parallel(tmp_path: Path, monkeypatch):
    _plain_flags(monkeypatch)
    srcs = []
    for name, value in (("a.cpp", 3), ("b.cpp", 4), ("c.cpp", 5)):
        src = tmp_path / name
        src.write_text(f'namespace {{ int v() {{ return {value}; }} }}\nextern "C" int get_{name[0]}() {{ return v(); }}\n')
        srcs.append(src)  # each has an anonymous-namespace v(): fine within one unit only if the units are split right
    out = tmp_path / "lib.so"
    cext._compile("g++", (srcs[0],), tmp_path / "one.so", 1)
    cext._compile("g++", tuple(srcs), out, 3)  # three units, one source each (a unity build would clash on v)
    lib = ctypes.CDLL(str(out))
    assert (lib.get_a(), lib.get_b(), lib.get_c()) == (3, 4, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.cpp", "b.cpp", "c.cpp", "lib.so", "one.so"]  # no leftovers


@needs_gxx
def test_compile_error_raises_with_the_compilers_message(tmp_path: Path, monkeypatch):
    _plain_flags(monkeypatch)
    good, bad = tmp_path / "good.cpp", tmp_path / "bad.cpp"
    good.write_text('extern "C" int ok() { return 1; }\n')
    bad.write_text("int broken( { return 1; }\n")
    with pytest.raises(RuntimeError, match=r"building lib\.so failed:(.|\n)*error"):
        cext._compile("g++", (good, bad), tmp_path / "lib.so", 2)
    assert not (tmp_path / "lib.so").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.cpp", "good.cpp"]


@needs_gxx
def test_an_interrupt_leaves_no_compiler_running(tmp_path: Path, monkeypatch):
    """Ctrl-C while waiting for the first unit: the other g++ processes are killed, not left running on the temporary
    directory that is being deleted."""
    _plain_flags(monkeypatch)
    srcs = []
    for name in ("a.cpp", "b.cpp"):
        srcs.append(tmp_path / name)
        srcs[-1].write_text(f'extern "C" int f_{name[0]}() {{ return 1; }}\n')
    started = []

    class Recording(cext.subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

        def communicate(self, *args, **kwargs):
            raise KeyboardInterrupt

    monkeypatch.setattr(cext.subprocess, "Popen", Recording)
    with pytest.raises(KeyboardInterrupt):
        cext._compile("g++", tuple(srcs), tmp_path / "lib.so", 2)
    assert len(started) == 2 and all(p.returncode is not None for p in started)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.cpp", "b.cpp"]


def test_a_timeout_kills_the_compilers_children_too(tmp_path: Path, monkeypatch):
    """g++ runs cc1plus as a child: a build past BUILD_TIMEOUT_S kills the whole process group, so no compiler is left
    running as an orphan (a kill of g++ alone left cc1plus compiling for minutes). A fake compiler stands in: a shell
    script that starts a long-running child, records its pid and waits for it."""
    import time

    pids = tmp_path / "pids"
    pids.mkdir()
    fake = tmp_path / "fake-gxx"
    fake.write_text(f"#!/bin/sh\nsleep 60 > /dev/null 2>&1 &\necho $! > {pids}/$$\nwait\n")
    fake.chmod(0o755)
    monkeypatch.setattr(cext, "BUILD_TIMEOUT_S", 1)
    src = tmp_path / "a.cpp"
    src.write_text("int f() { return 1; }\n")
    with pytest.raises(RuntimeError, match="timed out"):
        cext._compile(str(fake), (src,), tmp_path / "lib.so", 1)
    children = [int(p.read_text()) for p in pids.iterdir()]
    assert children
    for pid in children:
        for _ in range(100):  # the kill is delivered at once; the exit of the child may take a moment
            if not _running(pid):
                break
            time.sleep(0.01)
        else:
            pytest.fail(f"the compiler's child {pid} is still running")


def _running(pid: int) -> bool:
    """Whether the process runs (a killed one that its new parent has not reaped yet is a zombie, state Z)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_processes_that_need_the_library_at_once_build_it_once(tmp_path, monkeypatch):
    """Two builders at the same time (pytest's workers on a fresh machine): the second waits on the lock while the
    first compiles, then finds the library and does not compile it again."""
    import fcntl
    import threading

    monkeypatch.setenv("GLM_LIGHTNING_CACHE", str(tmp_path))
    builds, first_inside, second_waiting, release = [], threading.Event(), threading.Event(), threading.Event()
    real_flock = fcntl.flock

    def fake_build(cxx, out, verbose):
        builds.append(threading.current_thread().name)
        first_inside.set()
        assert release.wait(30), "the second builder never reached the lock"
        out.write_bytes(b"library")
        return out

    def flock(fd, op):
        if threading.current_thread().name == "second":
            second_waiting.set()
        return real_flock(fd, op)

    monkeypatch.setattr(cext, "_build_locked", fake_build)
    monkeypatch.setattr(cext.fcntl, "flock", flock)
    monkeypatch.setattr(cext.shutil, "which", lambda name: "/usr/bin/true")
    results = {}
    first = threading.Thread(target=lambda: results.update(first=cext.build()), name="first")
    first.start()
    assert first_inside.wait(30)
    second = threading.Thread(target=lambda: results.update(second=cext.build()), name="second")
    second.start()
    assert second_waiting.wait(30)
    release.set()
    first.join(30)
    second.join(30)
    assert builds == ["first"]
    assert results["first"] == results["second"] == cext.library_path()
    assert cext.library_path().read_bytes() == b"library"


AARCH64_CXX = shutil.which("aarch64-linux-gnu-g++")


@pytest.mark.skipif(AARCH64_CXX is None, reason="no aarch64 cross compiler (apt-get install g++-aarch64-linux-gnu)")
def test_the_library_compiles_for_aarch64(tmp_path: Path):
    """Every source of the library compiles for aarch64 (ARM laptops and servers), with the build's own flags but the
    target armv8-a: one translation unit of all sources, as the build makes them, into an AArch64 object. Compiled at
    -O0 (this checks the code, not its speed: ~16 s of CPU instead of minutes at -O3); not linked (torch's libraries
    here are x86)."""
    unit = tmp_path / "unit.cpp"
    unit.write_text("".join(f'#include "{src}"\n' for src in cext.SOURCES))
    flags = [f for f in cext._compile_flags("armv8-a") if not f.startswith("-O")]
    assert "-march=armv8-a" in flags
    obj = tmp_path / "unit.o"
    res = subprocess.run([AARCH64_CXX, "-c", str(unit), *flags, "-O0", "-o", str(obj)], capture_output=True, text=True,
                         timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]
    header = obj.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and header[4] == 2  # a 64-bit ELF object
    assert int.from_bytes(header[18:20], "little") == 183  # e_machine EM_AARCH64
