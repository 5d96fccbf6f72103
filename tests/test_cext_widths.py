"""The C++ kernels' vector width follows the compiler's target (csrc/lanes.h: 16 fp32 lanes with AVX-512, 8 with AVX2,
4 with SSE or NEON), so every helper and kernel must work at each width. This AVX-512-or-not x86 machine can run the
narrower x86 targets' code:

- the lane helpers (sum, sums16; load_bf16 against the scalar shift; transpose, store_bf16 against scalar
  rounding) at every width, bit for bit against a scalar
  tree in the same order: a tiny program including lanes.h, compiled and run per target (~1 s each; for aarch64,
  compiled only where a cross compiler is);
- every op of the library built for AVX2 (-march=haswell) and for SSE only (-march=x86-64-v2) against its PyTorch form
  (the op test files of OP_TESTS, run in a process that loads that library). Such a build takes minutes of g++
  (haswell here: 249 s of wall time, 145 s of g++ CPU, on the loaded 2-core machine), too slow for the suite: the
  test runs where the library is already built (``GLM_LIGHTNING_EXT_MARCH=haswell make ext``) and skips, saying how,
  where not.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from glm_lightning.model import cext

LANES_H = Path(cext.__file__).parent / "csrc" / "lanes.h"
ROOT = Path(__file__).resolve().parent.parent

TARGETS = {"native": None, "haswell": {"avx2", "fma"}, "x86-64-v2": {"sse4_2", "popcnt"}}
"""-march targets this machine can run: None (its own) or the CPU flags the target needs."""
WIDTH = {"haswell": 8, "x86-64-v2": 4}
OP_TESTS = ("tests/test_ops.py", "tests/test_linear.py", "tests/test_dsa.py", "tests/test_mhc_cpp.py", "tests/test_moe.py",
            "tests/test_norm.py", "tests/test_kda.py", "tests/test_panel_matmul.py")
"""The ops against their PyTorch and reference forms (~30 s with the library built)."""

CHECK = r"""
#include <cstdio>
#include <random>
#include "LANES_H"
using namespace glm_lightning_ops;
template <typename T> T tree(const T* v) {  // lanes N/2 apart first, then N/4, ..., 1
  T a[kLanes];
  for (int i = 0; i < kLanes; ++i) a[i] = v[i];
  for (int g = kLanes / 2; g >= 1; g /= 2)
    for (int i = 0; i < g; ++i) a[i] = a[i] + a[i + g];
  return a[0];
}
template <typename T> int check() {
  using L = Lanes<T>;
  std::mt19937 rng(1);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  int bad = 0;
  for (int rep = 0; rep < 200; ++rep) {
    T raw[kLanes * kLanes];
    for (auto& x : raw) x = T(u(rng) * (1 << (rng() % 20)));  // magnitudes apart: the order of the adds shows
    typename L::Vec v[kLanes];
    for (int i = 0; i < kLanes; ++i) v[i] = L::load(raw + i * kLanes);
    T sums[kLanes], back[kLanes];
    L::store(sums, L::sums16(v));
    for (int i = 0; i < kLanes; ++i) {
      const T want = tree(raw + i * kLanes), one = L::sum(v[i]);
      bad += std::memcmp(&want, &sums[i], sizeof(T)) != 0;
      bad += std::memcmp(&want, &one, sizeof(T)) != 0;
      L::store(back, v[i]);
      bad += std::memcmp(back, raw + i * kLanes, sizeof back) != 0;
    }
  }
  return bad;
}
int check_bf16() {  // load_bf16: each lane the fp32 whose upper half is the bf16's bits (any bits: signs, inf, nan)
  std::mt19937 rng(2);
  int bad = 0;
  for (int rep = 0; rep < 200; ++rep) {
    uint16_t raw[kLanes];
    float got[kLanes];
    for (auto& b : raw) b = uint16_t(rng());
    Lanes<float>::store(got, load_bf16(raw));
    for (int i = 0; i < kLanes; ++i) {
      const uint32_t want = uint32_t(raw[i]) << 16;
      bad += std::memcmp(&want, &got[i], sizeof want) != 0;
    }
  }
  return bad;
}
int check_transpose_and_store_bf16() {  // transpose: r[i][j] -> r[j][i]; store_bf16: nearest even, NaN -> 0x7FC0
  std::mt19937 rng(3);
  int bad = 0;
  for (int rep = 0; rep < 50; ++rep) {
    float raw[kLanes * kLanes], got[kLanes * kLanes];
    for (auto& x : raw) {
      uint32_t bits = rng();
      if (rng() % 4 == 0) bits = (bits & 0xFFFF0000u) | 0x8000u;  // a tie: rounds to the even neighbour
      std::memcpy(&x, &bits, sizeof x);  // any bits: signs, subnormals, inf, nan
    }
    Lanes<float>::Vec v[kLanes];
    for (int i = 0; i < kLanes; ++i) v[i] = Lanes<float>::load(raw + i * kLanes);
    Lanes<float>::transpose(v);
    for (int i = 0; i < kLanes; ++i) Lanes<float>::store(got + i * kLanes, v[i]);
    for (int i = 0; i < kLanes; ++i)
      for (int j = 0; j < kLanes; ++j) bad += std::memcmp(&got[i * kLanes + j], &raw[j * kLanes + i], 4) != 0;
    uint16_t h[kLanes];
    store_bf16(h, v[0]);
    for (int j = 0; j < kLanes; ++j) {
      uint32_t u;
      std::memcpy(&u, &got[j], 4);
      const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
      const uint16_t want = nan ? 0x7FC0 : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
      bad += h[j] != want;
    }
  }
  return bad;
}
int main() {
  std::printf("%d %d %d\n", kLanes, check<float>() + check_bf16() + check_transpose_and_store_bf16(), check<double>());
  return 0;
}
""".replace("LANES_H", str(LANES_H))


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _runnable(march: str) -> str | None:
    """Why this machine cannot run code for ``march`` (None: it can)."""
    if shutil.which("g++") is None:
        return "no g++"
    if march == "native":
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        return "not an x86 machine"
    missing = TARGETS[march] - _cpu_flags()
    return f"this CPU lacks {sorted(missing)}" if missing else None


@pytest.mark.parametrize("march", TARGETS)
def test_the_lane_helpers_sum_in_tree_order_at_the_targets_width(tmp_path: Path, march: str):
    why = _runnable(march)
    if why:
        pytest.skip(why)
    src, exe = tmp_path / "check.cpp", tmp_path / "check"
    src.write_text(CHECK)
    res = subprocess.run(["g++", "-O2", f"-march={march}", "-std=c++20", str(src), "-o", str(exe)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    lanes, bad_float, bad_double = map(int, subprocess.run([str(exe)], capture_output=True, text=True,
                                                           timeout=60).stdout.split())
    assert (bad_float, bad_double) == (0, 0)
    if march in WIDTH:
        assert lanes == WIDTH[march]
    else:  # this CPU's own width
        assert lanes == (16 if "avx512f" in _cpu_flags() else 8 if "avx" in _cpu_flags() else 4)


AARCH64_CXX = shutil.which("aarch64-linux-gnu-g++")


@pytest.mark.skipif(AARCH64_CXX is None, reason="no aarch64 cross compiler (apt-get install g++-aarch64-linux-gnu)")
def test_the_lane_helpers_compile_for_aarch64_at_4_lanes(tmp_path: Path):
    src = tmp_path / "check.cpp"
    src.write_text(CHECK + "static_assert(glm_lightning_ops::kLanes == 4, \"NEON: 4 fp32 lanes\");\n")
    res = subprocess.run([AARCH64_CXX, "-c", "-O2", "-march=armv8-a", "-std=c++20", str(src), "-o",
                          str(tmp_path / "check.o")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]


@pytest.mark.parametrize("march", ["haswell", "x86-64-v2"])
def test_every_op_built_for_a_narrower_target_matches_its_pytorch_form(march: str, monkeypatch):
    why = _runnable(march)
    if why:
        pytest.skip(why)
    monkeypatch.setenv("GLM_LIGHTNING_EXT_MARCH", march)
    if not cext.enabled():
        pytest.skip("the C++ ops are switched off (GLM_LIGHTNING_EXT=0)")
    if not cext.library_path().exists():
        pytest.skip(f"the {march} library is not built (minutes of g++, too slow for the suite): "
                    f"GLM_LIGHTNING_EXT_MARCH={march} make ext")
    code = ("import sys, pytest\n"
            "from glm_lightning.model import cext\n"
            f"assert cext.target_march() == {march!r} and cext.available(), 'the {march} library did not load'\n"
            "sys.exit(pytest.main(['-q', '-x', '-p', 'no:cacheprovider', *sys.argv[1:]]))\n")
    env = {**os.environ, "GLM_LIGHTNING_EXT_MARCH": march, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", code, *OP_TESTS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    assert " passed" in res.stdout and " failed" not in res.stdout
