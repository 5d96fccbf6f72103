"""`make bench`: every benchmark, each in its own process (so peak RSS is per benchmark), one summary table,
numbers saved to benchmarks/results/latest.json.

    python -m benchmarks [--quick] [--threads auto|1|2]
                         [--only ops,cext,op_choice,kda,train,bf16,generation,vs_commit,verifier,rl,cli]

The saved file keeps one row per benchmark: a run replaces the rows of the benchmarks it measured (each stamped with
its time, `measured_utc`) and keeps every other row, so `--only kda` or a failed benchmark never loses the rest.

`--threads auto` (the default) uses glm_lightning.threads.choose_threads: one thread per core that other
processes do not already keep busy (see that module for why).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from glm_lightning.threads import choose_threads

BENCHES = ("ops", "cext", "op_choice", "kda", "train", "bf16", "generation", "vs_commit", "verifier", "rl", "cli")
RESULTS = Path(__file__).parent / "results" / "latest.json"

CHILD = """
import json, sys, importlib, resource, torch
name, quick, threads, out = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(threads)
res = importlib.import_module(f"benchmarks.bench_{name}").run(quick=quick)
res.setdefault("threads", threads)
from glm_lightning import machine
res.setdefault("machine", machine.describe({**machine.machine_info(), "threads": threads}))
res.setdefault("peak_rss_mb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
json.dump(res, open(out, "w"), default=str)
"""


def summary_rows(results: dict) -> list[tuple[str, str, str, str]]:
    """(benchmark, result, target, machine) rows: each names the machine its benchmark ran on (CPU model, torch's
    CPU capability, threads)."""
    rows = []
    for name, r in results.items():
        rows += [(*row, r.get("machine", "") if isinstance(r, dict) else "") for row in _rows_of(name, results)]
    return rows


def _rows_of(name: str, results: dict) -> list[tuple[str, str, str]]:
    """The summary rows of one benchmark's results."""
    rows: list[tuple[str, str, str]] = []
    results = {name: results[name]}
    if "cli" in results:
        c = results["cli"]
        slowest = max(c["seconds"].items(), key=lambda kv: kv[1])
        rows.append(("CLI latency", f"{len(c['seconds'])} commands: --help {c['seconds'].get('--help', 0):.2f} s, "
                                    f"fit --help {c['seconds'].get('fit --help (cached)', 0):.2f} s, config error "
                                    f"{c['seconds'].get('error: empty config file', 0):.2f} s; slowest "
                                    f"{slowest[0]} {slowest[1]:.2f} s", f"each < {c['target_s']:g} s"))
    if "ops" in results:
        for name, r in results["ops"].items():
            if isinstance(r, dict):
                rows.append((f"ops {name}", f"{r['total']:,} ATen ops/step (fwd {r['forward']:,}, bwd {r['backward']:,}, "
                                            f"AdamW {r['optimizer']:,})", f"<= {r['target']:,}"))
    if "op_choice" in results:
        o = results["op_choice"]
        t = o["table"]
        flips = ", ".join(f"{k} -> {v}" for k, v in t["changes"].items()) or "none"
        rows.append(("op choice", f"table {t['digest']} ({t['source']}): {len(o['rows']) - len(o['slower'])} of "
                                  f"{len(o['rows'])} chosen forms as fast as the other within noise"
                                  + (f" (slower: {', '.join(o['slower'])})" if o["slower"] else ""),
                     "every chosen >= other"))
        rows.append(("op table", f"departures from the shipped defaults: {flips}", ""))
    if results.get("cext", {}).get("available"):
        c = results["cext"]
        rows.append(("C++ ops", f"study step {c['seconds_per_step_off']:.3f} -> {c['seconds_per_step_on']:.3f} s "
                                f"({c['speedup']:.2f}x), {c['ops_off']:,} -> {c['ops_on']:,} ops, "
                                f"RSS {c['peak_rss_mb']:.0f} MB", "on >= off"))
    if results.get("kda", {}).get("available"):
        k = results["kda"]
        rows.append(("KDA core", ", ".join(f"{n} {k[n]['eager_ms']:.1f} -> {k[n]['cpp_ms']:.1f} ms "
                                            f"({k[n]['speedup']:.2f}x)" for n in ("flash-25m", "study"))
                     + f", RSS {k['peak_rss_mb']:.0f} MB", "C++ recurrence >= eager chunked"))
    if "train" in results:
        t = results["train"]
        for name in ("hybrid flash-25m", "dense baseline"):
            r = t[name]
            rows.append((f"train {name.split()[0]}", f"{r['tokens_per_s']:.0f} tok/s, MFU {r['mfu']:.1%} of the fp32 "
                                                      f"GEMM peak {t['peak_gflops']:.0f} GFLOP/s (6 x active params/tok),"
                                                      f" RSS {r['peak_rss_mb']:.0f} MB",
                         "MFU >= 60%" if name.startswith("hybrid") else ""))
        rows.append(("train ratio", f"hybrid/dense {t['hybrid_over_dense']:.2f}x", ">= 0.8x"))
    if "bf16" in results:
        b, p = results["bf16"], results["bf16"]["peak_gflops"]
        native = "native" if b["native_bf16"] else "NOT native (emulated)"
        rows.append(("bf16 peaks", f"bf16 {native}: GEMM fp32 {p['fp32']:.0f}, bf16 native {p['native']:.1f}, "
                                   f"bf16 emulated {p['emulated']:.0f} GFLOP/s", ""))
        t = b["train"]
        full, small = f"{b['batch']}x{b['seq']}", f"{b['native_batch']}x{b['seq']}"
        if full == small:  # native bf16: measured at the full size
            rows.append(("bf16 train MFU", f"flash-25m {full}: fp32 {t['fp32 ' + full]['mfu']:.1%} of the fp32 peak, "
                                           f"bf16-mixed {t['native ' + full]['mfu']:.1%} of the bf16 peak", ""))
        rows.append(("bf16 train", f"flash-25m {full}: fp32 {t['fp32 ' + full]['tokens_per_s']:.0f}, emulated "
                                   f"{t['emulated ' + full]['tokens_per_s']:.0f} tok/s ({b['train_emulated_over_fp32']:.2f}x);"
                                   f" {small}: native {b['train_native_over_fp32']:.2f}x fp32", ">= 1.6x (native bf16)"))
        g = b["generation"]
        ratio = b["generation_bf16_over_fp32"]
        rows.append(("bf16 generation", f"16x48 cached: fp32 {g['fp32']['tokens_per_s']:.0f}, bf16 weights "
                                        f"{g['bf16']['tokens_per_s']:.0f} tok/s ({ratio:.2f}x)", ">= 1.5x (native bf16)"))
    if "generation" in results:
        g = results["generation"]
        rows.append(("generation", f"cached {g['cached_tokens_per_s']:.0f} tok/s, naive "
                                   f"{g['naive_tokens_per_s']:.0f} tok/s, {g['speedup']:.1f}x, "
                                   f"RSS {g['peak_rss_mb']:.0f} MB", "cached >= 25x naive"))
        if "compute_bound_tokens_per_s" in g:
            rows.append(("decode bounds", f"cached {g['compute_bound_fraction']:.1%} of the compute bound "
                                          f"({g['compute_bound_tokens_per_s']:,.0f} tok/s at {g['peak_gflops']:.0f} "
                                          f"GFLOP/s), {g['bandwidth_bound_fraction']:.1%} of the bandwidth bound "
                                          f"({g['bandwidth_bound_tokens_per_s']:,.0f} tok/s: "
                                          f"{g['bytes_per_step'] / 1e6:.0f} MB/step at {g['bandwidth_gbs']:.1f} GB/s)",
                         ">= 30% of compute"))
    if "vs_commit" in results:
        v = results["vs_commit"]
        rows.append(("study steps", f"{v['new_steps_per_s']:.2f} steps/s vs {v['old_steps_per_s']:.2f} at {v['rev']}: "
                                    f"{v['speedup']:.2f}x, RSS {v['peak_rss_mb_new']:.0f} MB", ">= 3x"))
    if "verifier" in results:
        v = results["verifier"]
        rows.append(("verifier", f"batched {v['check_many']['verdicts_per_s']:.0f} verdicts/s, "
                                 f"{v['ratio_batched_over_baseline']:.1f}x the subprocess baseline, "
                                 f"RSS {v.get('peak_rss_mb', float('nan')):.0f} MB",
                     ">= 300 verdicts/s batched"))
    if "rl" in results:
        g, a, e = results["rl"]["generation"], results["rl"]["compaction"], results["rl"]["epoch"]
        rows.append(("RL generation", f"{g['prompts']}x{g['samples']} rows x {g['new_tokens']} tok: "
                                      f"{g['tokens_per_s']:.0f} generated tok/s, RSS {g['peak_rss_mb']:.0f} MB; "
                                      f"dropping finished rows {a['speedup']:.2f}x", ">= 1,500 tok/s"))
        if "update" in results["rl"]:
            u = results["rl"]["update"]
            rows.append(("RL update", f"policy fwd+bwd, each prompt once vs full rows: {u['speedup']:.2f}x", ""))
        rows.append(("RL epoch", f"{e['wall_s']:.0f} s: gen {e['generation_s']:.0f} + verifier {e['verifier_s']:.0f} "
                                 f"+ ref {e['ref_logprobs_s']:.0f} + update {e['policy_update_s']:.0f} s, "
                                 f"RSS {e['peak_rss_mb']:.0f} MB", "<= 600 s"))
    return rows


def read_saved(path: Path) -> dict:
    """The saved rows ({} when there is no file yet); a file that is not a JSON object is a one-line error, before
    any benchmark runs (it is never overwritten)."""
    if not path.exists():
        return {}
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: {path} is not readable JSON ({err}); move it away to start a new one") from None
    if not isinstance(saved, dict):
        raise SystemExit(f"error: {path} holds no benchmark rows (a JSON object); move it away to start a new one")
    return saved


def save_merged(path: Path, saved: dict, new: dict) -> None:
    """Write `saved` with the rows of `new` replaced (atomically); nothing new, nothing written."""
    if not new:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({**saved, **new}, indent=2, default=str))
    os.replace(tmp, path)


def run_benches(names: Sequence[str], quick: bool, threads: int) -> tuple[dict, list[str]]:
    """Each benchmark in its own process: (results by name, names that failed)."""
    results, failed = {}, []
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    for name in names:
        print(f"\n=== {name} ===", flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            rc = subprocess.run([sys.executable, "-c", CHILD, name, "1" if quick else "0", str(threads),
                                 f.name], env=env).returncode
            if rc != 0:
                failed.append(name)
                continue
            results[name] = {**json.load(open(f.name)),
                             "measured_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    return results, failed


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--only", default=",".join(BENCHES), help="comma-separated benchmarks (default: all)")
    p.add_argument("--threads", default="auto", help="torch threads, or 'auto' (threads.choose_threads)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHES]
    if unknown or not names:
        raise SystemExit(f"error: --only {args.only!r}: choose from {','.join(BENCHES)}")
    saved = read_saved(RESULTS)
    threads = choose_threads() if args.threads == "auto" else int(args.threads)
    print(f"threads: {threads} ({args.threads})")
    results, failed = run_benches(names, args.quick, threads)
    print("\n=== summary ===")
    print(f"{'benchmark':<16}{'result':<104}{'target':<22}machine")
    for row in summary_rows(results):
        print(f"{row[0]:<16}{row[1]:<104}{row[2]:<22}{row[3]}")
    save_merged(RESULTS, saved, results)
    kept = sorted(set(saved) - set(results))
    if results:
        print(f"saved {RESULTS}" + (f" (rows kept from earlier runs: {', '.join(kept)})" if kept else ""))
    if failed:
        sys.exit(f"benchmarks failed: {failed}")


if __name__ == "__main__":
    main()
