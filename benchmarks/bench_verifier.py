"""Verifier throughput: verdicts per second for trivial correct functions with 5 tests each.

Modes:
  baseline        one fresh `python -I -S` subprocess per candidate doing the same work (exec, 5 calls, JSON result
                  on stdout, compared in the parent), `workers` at a time from a thread pool;
  check           Verifier.check, one candidate at a time;
  check_many      Verifier.check_many, one batch, `workers` zygotes;
  check_many xN   the same with more zygotes than cores (hides scheduling latency on a busy machine).

Also prints where a candidate's time goes (wall clock, batched): fork (zygote fork until the child runs), namespace
and confinement setup (reading its job, uid drop, rlimits, audit hook), run (candidate plus process exit) and cleanup
(kill, reap, wiping the working directory and the private temp dirs), the one-off server start per worker (launcher,
namespaces, tmpfs mounts, zygote, self test) amortised over the batch, and the CPU time per verdict. Every check_many
forks one child per job, and that child reads only its own job.

Then the per-verdict cost of the kernel layer (seccomp allowlist + private root) and of the issue-46 defences: the
same batch with them on and off (test-only switches), alternated in one sitting.

    python -m benchmarks.bench_verifier            # full run (~1 minute)
    python -c "from benchmarks.bench_verifier import run; run(quick=True)"
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from glm_lightning.verifier import Verifier

WORKERS = 2
SOURCE = "def increment(x):\n    return x + 1\n"
TESTS = [((x,), x + 1) for x in (-3, 0, 7, 99, 1000)]

# What the baseline subprocess runs: the same work as the sandbox child, with none of its protections.
BASELINE_RUNNER = (
    "import json, sys\n"
    "job = json.loads(sys.stdin.read())\n"
    "ns = {}\n"
    "exec(compile(job['source'], '<candidate>', 'exec'), ns)\n"
    "fn = ns[job['entry_point']]\n"
    "out = []\n"
    "for args in job['inputs']:\n"
    "    try:\n"
    "        value = fn(*args)\n"
    "        out.append([type(value).__name__, value])\n"
    "    except BaseException as exc:\n"
    "        out.append(['raised', type(exc).__name__])\n"
    "sys.stdout.write(json.dumps(out))\n"
)


def _baseline_one(_: int) -> bool:
    job = json.dumps({"source": SOURCE, "entry_point": "increment", "inputs": [list(a) for a, _ in TESTS]})
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", BASELINE_RUNNER], input=job, capture_output=True,
                          text=True, timeout=10, env={"PATH": "/usr/bin:/bin"}, cwd="/")
    try:
        results = json.loads(proc.stdout)
    except ValueError:
        return False
    return proc.returncode == 0 and all(r == [type(exp).__name__, exp] for r, (_, exp) in zip(results, TESTS))


def _rate(n: int, seconds: float) -> dict[str, float]:
    return {"n": n, "seconds": seconds, "verdicts_per_s": n / seconds, "ms_per_verdict": 1000 * seconds / n}


def bench_baseline(n: int, workers: int = WORKERS) -> dict[str, float]:
    cpu_before = _cpu_children_s()
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        ok = list(pool.map(_baseline_one, range(n)))
    result = _rate(n, time.perf_counter() - start)
    result["cpu_ms_per_verdict"] = 1000 * (_cpu_children_s() - cpu_before) / n
    assert all(ok), "baseline runner produced wrong results"
    return result


def _cpu_children_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bench_verifier(n_single: int, n_batch: int, workers: int = WORKERS) -> dict[str, Any]:
    """check one at a time, then check_many; CPU per verdict is measured after close (children reaped)."""
    out: dict[str, Any] = {}
    items = [(SOURCE, "increment", TESTS)] * n_batch
    cpu_before = _cpu_children_s()
    parent_before = os.times()
    started = time.perf_counter()
    with Verifier(timeout_s=2.0, memory_mb=256, workers=workers) as verifier:
        out["server_start_ms"] = 1000 * (time.perf_counter() - started)
        verifier.check(SOURCE, "increment", TESTS)  # warm-up
        if n_single:
            start = time.perf_counter()
            for _ in range(n_single):
                assert verifier.check(SOURCE, "increment", TESTS).passed
            out["check"] = _rate(n_single, time.perf_counter() - start)
        for key in verifier.stats:
            verifier.stats[key] = 0
        start = time.perf_counter()
        verdicts = verifier.check_many(items)
        out["check_many"] = _rate(n_batch, time.perf_counter() - start)
        assert all(v.passed for v in verdicts)
        stats = dict(verifier.stats)
        out["protections"] = verifier.protections
    parent_after = os.times()
    cpu_total = _cpu_children_s() - cpu_before
    count = max(1, stats["candidates"])
    out["breakdown_ms"] = {
        "fork": 1000 * stats["fork_s"] / count,
        "namespace_and_confine_setup": 1000 * stats["setup_s"] / count,
        "run_and_exit": 1000 * stats["run_s"] / count,
        "cleanup": 1000 * stats["cleanup_s"] / count,
        "server_start_amortised": out["server_start_ms"] / max(1, n_batch + n_single + 1),
        "round_trip": 1000 * stats["round_trip_s"] / count,
    }
    verdicts_total = n_single + n_batch + 1
    out["cpu_ms_per_verdict"] = {
        "sandbox": 1000 * cpu_total / verdicts_total,  # zygotes + children (+ start-up, amortised)
        "parent": 1000 * ((parent_after.user + parent_after.system) - (parent_before.user + parent_before.system))
        / verdicts_total,
    }
    return out


LAYER_SWITCHES = ("GLM_VERIFIER_UNSAFE_NO_SECCOMP", "GLM_VERIFIER_UNSAFE_NO_PRIVATE_ROOT")


def bench_kernel_layer(n_batch: int, rounds: int = 3, workers: int = WORKERS) -> dict[str, Any]:
    """Per-verdict cost of the issue-30 layer (seccomp allowlist + private root), alternating on/off in one sitting:
    each round runs the same batch with the layer on and off (test-only switches), and the best of the rounds is
    kept for each (the machine is shared: the fastest run is the least disturbed)."""
    return _alternate({name: "1" for name in LAYER_SWITCHES}, n_batch, rounds, workers)


def bench_issue46(n_batch: int, rounds: int = 3, workers: int = WORKERS) -> dict[str, Any]:
    """Per-verdict cost of the issue-46 defences (argument-checked seccomp rules, a uid per job, the /proc view,
    the resident private root), all switched off together through the test-only switch, alternated in one sitting
    like bench_kernel_layer."""
    from glm_lightning.verifier.defences import DEFENCES, ENV

    return _alternate({ENV: ",".join(DEFENCES)}, n_batch, rounds, workers)


def _alternate(off_env: dict[str, str], n_batch: int, rounds: int, workers: int) -> dict[str, Any]:
    """Best of `rounds` batches with `off_env` unset ("on") and set ("off"), alternated."""
    import logging

    quiet = logging.getLogger("glm_lightning.verifier")
    quiet.setLevel(logging.ERROR)  # "off" is a weaker sandbox on purpose: no warning per round
    best: dict[str, Any] = {}
    saved = {name: os.environ.get(name) for name in off_env}
    try:
        for _ in range(rounds):
            for mode in ("on", "off"):
                for name, value in off_env.items():
                    if mode == "off":
                        os.environ[name] = value
                    else:
                        os.environ.pop(name, None)
                got = bench_verifier(0, n_batch, workers)
                row = {"verdicts_per_s": got["check_many"]["verdicts_per_s"],
                       "cpu_ms": got["cpu_ms_per_verdict"]["sandbox"], "server_start_ms": got["server_start_ms"]}
                if mode not in best or row["verdicts_per_s"] > best[mode]["verdicts_per_s"]:
                    best[mode] = row
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        quiet.setLevel(logging.NOTSET)
    best["cost_ms_per_verdict"] = {"wall": 1000 / best["on"]["verdicts_per_s"] - 1000 / best["off"]["verdicts_per_s"],
                                   "cpu": best["on"]["cpu_ms"] - best["off"]["cpu_ms"]}
    return best


def run(quick: bool = False) -> dict[str, Any]:
    """Measure and print; returns every number as a dict."""
    n_base, n_single, n_batch = (30, 60, 300) if quick else (100, 200, 1500)
    results: dict[str, Any] = {"workers": WORKERS, "cpus": os.cpu_count(), "quick": quick}
    try:
        results["loadavg_before"] = os.getloadavg()[0]
    except OSError:
        pass
    results["baseline"] = bench_baseline(n_base)
    main = bench_verifier(n_single, n_batch)
    results["check"], results["check_many"] = main["check"], main["check_many"]
    results["breakdown_ms"], results["cpu_ms_per_verdict"] = main["breakdown_ms"], main["cpu_ms_per_verdict"]
    wide = bench_verifier(0, n_batch, workers=2 * WORKERS)
    results[f"check_many_x{2 * WORKERS}"] = wide["check_many"]
    results["kernel_layer"] = bench_kernel_layer(n_batch // 2)
    results["issue46_defences"] = bench_issue46(n_batch // 2)
    results["ratio_batched_over_baseline"] = results["check_many"]["verdicts_per_s"] / \
        results["baseline"]["verdicts_per_s"]
    results["protections"] = {k: v for k, v in main["protections"].items()
                              if k in ("launcher", "private_root", "seccomp", "mount_namespace", "private_tmpfs",
                                       "ipc_namespace",
                                       "network_namespace", "pid_namespace", "unprivileged_uid", "nproc_enforced",
                                       "audit_hook", "one_job_per_child")}
    try:
        results["loadavg_after"] = os.getloadavg()[0]
    except OSError:
        pass
    _print(results)
    return results


def _print(r: dict[str, Any]) -> None:
    print(f"verifier throughput, trivial correct function x 5 tests, {r['cpus']} CPUs, workers={r['workers']}, "
          f"load average {r.get('loadavg_before', float('nan')):.1f} -> {r.get('loadavg_after', float('nan')):.1f}")
    print(f"{'mode':<34}{'verdicts/s':>12}{'ms/verdict':>12}{'n':>7}")
    rows = [("baseline: fresh python -I -S each", r["baseline"]), ("Verifier.check (one at a time)", r["check"]),
            (f"Verifier.check_many (workers={r['workers']})", r["check_many"])]
    rows.append((f"Verifier.check_many (workers={2 * r['workers']})", r[f"check_many_x{2 * r['workers']}"]))
    for name, row in rows:
        print(f"{name:<34}{row['verdicts_per_s']:>12.1f}{row['ms_per_verdict']:>12.2f}{row['n']:>7}")
    print(f"ratio check_many / baseline: {r['ratio_batched_over_baseline']:.1f}x")
    b = r["breakdown_ms"]
    print("per-candidate wall time (ms, batched, one forked child per job): "
          f"fork {b['fork']:.2f}, namespace+confine setup {b['namespace_and_confine_setup']:.2f}, "
          f"run+exit {b['run_and_exit']:.2f}, cleanup {b['cleanup']:.2f}, server start amortised "
          f"{b['server_start_amortised']:.2f}; round trip incl. queueing {b['round_trip']:.1f}")
    c = r["cpu_ms_per_verdict"]
    print(f"CPU per verdict (ms): sandbox processes {c['sandbox']:.2f} + parent {c['parent']:.2f} "
          f"(baseline subprocess: {r['baseline']['cpu_ms_per_verdict']:.2f})")
    k = r["kernel_layer"]
    print(f"kernel layer (seccomp allowlist + private root), best of alternating runs, check_many: on "
          f"{k['on']['verdicts_per_s']:.0f}/s ({k['on']['cpu_ms']:.2f} ms CPU), off {k['off']['verdicts_per_s']:.0f}/s "
          f"({k['off']['cpu_ms']:.2f} ms CPU): {k['cost_ms_per_verdict']['wall']:+.2f} ms wall, "
          f"{k['cost_ms_per_verdict']['cpu']:+.2f} ms CPU per verdict; server start {k['on']['server_start_ms']:.0f} "
          f"vs {k['off']['server_start_ms']:.0f} ms")
    k = r["issue46_defences"]
    print(f"issue-46 defences (argument checks, uid per job, /proc view, resident root), best of alternating runs: "
          f"on {k['on']['verdicts_per_s']:.0f}/s ({k['on']['cpu_ms']:.2f} ms CPU), off {k['off']['verdicts_per_s']:.0f}"
          f"/s ({k['off']['cpu_ms']:.2f} ms CPU): {k['cost_ms_per_verdict']['wall']:+.2f} ms wall, "
          f"{k['cost_ms_per_verdict']['cpu']:+.2f} ms CPU per verdict; server start {k['on']['server_start_ms']:.0f} "
          f"vs {k['off']['server_start_ms']:.0f} ms")
    print(f"protections: {r['protections']}")


if __name__ == "__main__":
    run()
