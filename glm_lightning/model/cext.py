"""The optional C++ library of the model's ops (csrc/*.cpp): built with g++ into a cached shared library and loaded
with `torch.ops.load_library`, once per process. The ops layer (glm_lightning/model/ops/) decides per call whether a
C++ op takes the tensors (ops/backend.py); its PyTorch forms run otherwise.

Why: the study model is bound by dispatch overhead (~15 us per ATen op), and a decode step by memory streams and runs
of tiny ops; a C++ op is one dispatched op forward and one backward for what eager PyTorch issues as tens or hundreds
(ops/*.py say how many, per op). No ninja and no pybind: g++ compiles a few translation units, each including several
sources (torch's headers are parsed once per unit), one per core up to MAX_JOBS, in parallel, and links them; the ops
register through TORCH_LIBRARY (schema `glm_lightning::...`).

    GLM_LIGHTNING_EXT=auto (default)  build at first use (~4 min of g++ CPU, ~2 min wall on 2 cores on
                                      an AVX2 machine, half that with AVX-512; once per source/torch
                                      version/CPU) and use it
    GLM_LIGHTNING_EXT=0               never build or load it: the PyTorch forms only
    GLM_LIGHTNING_EXT_MARCH=haswell   build for another x86 target than this CPU's (-march=native): the kernels'
                                      vector width follows it (kernel_helpers.h), so that this machine can run and
                                      test the AVX2 (haswell) or SSE (x86-64-v2) code (tests/test_cext_widths.py)
    make ext                          build now and print the library path and the build time

The library is cached under $GLM_LIGHTNING_CACHE (default ~/.cache/glm_lightning)/ext, keyed by a hash of the sources,
the torch version, the compiler flags and the CPU model (it is built with -march=native). If g++ is missing or the
build fails, a warning is printed once and the PyTorch forms run.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in (
    "sinkhorn.cpp", "state_scan.cpp", "streams.cpp", "kda_decode.cpp", "small_matmul.cpp", "kda_recurrent.cpp",
    "site_read.cpp", "short_conv.cpp", "swiglu.cpp", "moe_rows.cpp", "kda_pointwise.cpp", "moe_route.cpp",
    "rms_norm.cpp", "decode_attention.cpp", "panel_matmul.cpp", "rotary.cpp", "moe_decode.cpp",
    "block_decode.cpp"))
HEADERS = tuple(Path(__file__).parent / "csrc" / name for name in ("kernel_helpers.h", "lanes.h", "sinkhorn.h",
                                                                   "amx_panels.h"))
"""Included by the sources: hashed with them, so that a change rebuilds the library."""
BUILD_TIMEOUT_S = 2400
"""Upper bound of one build's wall time: ~4 min of g++ CPU time on a 2-core AVX2 machine (247 s; about 2 min of wall
time when it is idle), but a unit took over 15 min of wall time there while four other builds and test runs shared
the two cores (600 s killed it)."""
COMPILE_S = {"sinkhorn.cpp": 107.0, "kda_recurrent.cpp": 87.0}
"""Seconds of g++ per source beyond torch's headers (~13 s), measured one file at a time on an AVX2 machine (the
kernels' vectors were then 16 lanes, two AVX2 registers, so AVX2 machines compiled them 2-3x longer: 47 and 42 s on an
AVX-512 one; with the target's width, lanes.h, a whole AVX2 build took 145 s of g++ CPU against 202 s with 16 lanes on
the Intel Xeon); the other sources take 1-2 s (`DEFAULT_COMPILE_S`). Used only to balance the parallel build's
translation units."""
DEFAULT_COMPILE_S = 2.0
MAX_JOBS = 4
"""At most this many g++ processes at once (each holds ~1-1.5 GB)."""


def enabled() -> bool:
    """Whether the C++ ops may be used (GLM_LIGHTNING_EXT is not '0')."""
    return os.environ.get("GLM_LIGHTNING_EXT", "auto").strip().lower() not in ("0", "off", "false", "no")


def target_march() -> str:
    """The target the library is built for: this CPU's (``native``) unless GLM_LIGHTNING_EXT_MARCH names another."""
    return os.environ.get("GLM_LIGHTNING_EXT_MARCH", "").strip() or "native"


def _compile_flags(march: str | None = None) -> list[str]:
    """g++ flags for one translation unit: torch's headers (what torch.utils.cpp_extension would pass, without
    importing it: its import probes for CUDA and warns), OpenMP for at::parallel_for. ``march`` is the target (default
    :func:`target_march`; tests/test_cext_build.py cross-compiles for aarch64 with ``armv8-a``).

    The kernels are portable C++: their explicit vectors are GCC vector extensions as wide as one register of the
    target (lanes.h: 16 fp32 lanes with AVX-512, 8 with AVX2, 4 with SSE or NEON), and the only ISA-specific
    code (flushing denormals through MXCSR) is guarded for x86."""
    march = target_march() if march is None else march
    torch_dir = Path(torch.__file__).parent
    return ["-O3", f"-march={march}", "-std=c++20", "-fPIC", "-fopenmp",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", f"-I{torch_dir / 'include'}"]


def _link_flags() -> list[str]:
    """g++ flags that link the objects into the shared library against torch's libraries (torch's bundled libgomp is
    the one loaded)."""
    lib = Path(torch.__file__).parent / "lib"
    return ["-shared", "-fopenmp", f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]


def _jobs() -> int:
    """g++ processes to run at once: the cores this process may use, at most MAX_JOBS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_JOBS))


def _groups(sources: tuple[Path, ...], jobs: int) -> list[list[Path]]:
    """The sources split into at most `jobs` translation units of about equal compile time (longest first, each to the
    lightest unit; COMPILE_S), in their given order within a unit. One unit parses torch's headers once; two on two
    cores build in ~half the wall time (1 core: no gain, ~6 s more for the second parse)."""
    units: list[list[Path]] = [[] for _ in range(max(1, min(jobs, len(sources))))]
    load = [0.0] * len(units)
    for src in sorted(sources, key=lambda p: -COMPILE_S.get(p.name, DEFAULT_COMPILE_S)):
        i = load.index(min(load))
        units[i].append(src)
        load[i] += COMPILE_S.get(src.name, DEFAULT_COMPILE_S)
    order = {src: n for n, src in enumerate(sources)}
    return [sorted(unit, key=order.__getitem__) for unit in units if unit]


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill a compiler started in its own session: g++ and the cc1plus it runs."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, AttributeError):  # already gone, or no process groups (not POSIX)
        proc.kill()


def _compile(cxx: str, sources: tuple[Path, ...], out: Path, jobs: int) -> None:
    """Compile the sources as `jobs` translation units in parallel (each includes its sources: one parse of the
    headers per unit) and link them into `out`. Raises RuntimeError with g++'s message on failure."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        procs: list[tuple[list[str], subprocess.Popen]] = []
        objs, failed = [], None
        try:
            for n, unit in enumerate(_groups(sources, jobs)):
                cpp, obj = Path(tmp) / f"unit{n}.cpp", Path(tmp) / f"unit{n}.o"
                cpp.write_text("".join(f'#include "{src}"\n' for src in unit))
                cmd = [cxx, "-c", str(cpp), *_compile_flags(), "-o", str(obj)]
                # its own process group: g++ runs cc1plus as a child, which a kill of g++ alone left running
                procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                    start_new_session=True)))
                objs.append(str(obj))
            for cmd, proc in procs:
                try:
                    _, err = proc.communicate(timeout=BUILD_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    _kill_group(proc)
                    _, err = proc.communicate()
                    err = f"timed out after {BUILD_TIMEOUT_S} s\n{err}"
                if proc.returncode != 0 and failed is None:
                    failed = (cmd, err)
        finally:  # an interrupt (Ctrl-C) or a failed start: no g++ left running on the deleted directory
            for _, proc in procs:
                if proc.poll() is None:
                    _kill_group(proc)
                    proc.wait()
        if failed is None:
            cmd = [cxx, *objs, *_link_flags(), "-o", str(out)]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            failed = (cmd, res.stderr) if res.returncode != 0 else None
        if failed is not None:
            raise RuntimeError(f"building {out.name} failed:\n{' '.join(failed[0])}\n{failed[1][-4000:]}")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path() -> Path:
    """Where the library for the current sources, torch and CPU lives (built or not)."""
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.read_bytes())
    h.update(" ".join([torch.__version__, sys.version, platform.machine(), _cpu_model(), *_compile_flags(),
                       *_link_flags()]).encode())
    root = Path(os.environ.get("GLM_LIGHTNING_CACHE", Path.home() / ".cache" / "glm_lightning"))
    return root / "ext" / f"glm_lightning_ops_{h.hexdigest()[:16]}.so"


def build(verbose: bool = False) -> Path:
    """Compile the sources (if not cached) and return the library path. Raises on failure. Processes that need the
    library at the same time (pytest's workers, a sweep's runs) build it once: the first takes a lock beside it and
    the others wait for it, then load its result; the file appears by an atomic rename, never half written."""
    out = library_path()
    if out.exists():
        return out
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if out.exists():  # another process built it while this one waited
            return out
        return _build_locked(cxx, out, verbose)


def _build_locked(cxx: str, out: Path, verbose: bool) -> Path:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        jobs = _jobs()
        if verbose:
            print(f"building {out.name} with {jobs} g++ process(es)", file=sys.stderr)
        _compile(cxx, SOURCES, Path(tmp), jobs)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.lru_cache(maxsize=None)
def load() -> bool:
    """Build (if needed) and load the ops once per process; True if `torch.ops.glm_lightning` is usable."""
    if not enabled():
        return False
    try:
        torch.ops.load_library(str(build()))
    except Exception as e:  # a missing compiler or a failed build: the PyTorch forms still work
        warnings.warn(f"glm_lightning C++ ops unavailable, using the PyTorch forms ({e})", RuntimeWarning, stacklevel=2)
        return False
    return True


def available() -> bool:
    """Whether the C++ ops are loaded (building them on the first call, unless disabled)."""
    return load()

