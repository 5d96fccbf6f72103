"""How long a user waits for an answer from the command line: `--help` of every command, config and argument errors,
and the first line of a long command, each as a fresh `python -m glm_lightning` process (median of `rounds`).

Target (issue 48): every row under 3 s on the machine that measures it. `fit --help` is measured from its cache
(built by `make venv`, glm_lightning/help_cache.py) and once uncached; an unknown key nested inside a config section
needs the stage CLI's parser (Lightning's import), which is the slowest error and is shown as such.

    python -m benchmarks --only cli        # or: python -m benchmarks.bench_cli
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 3.0


def _time(argv: list[str], env: dict[str, str], first_line: bool = False) -> float:
    """Seconds until the process exits (or, with `first_line`, until it prints its first line)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "glm_lightning", *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if first_line:
        assert proc.stdout is not None
        proc.stdout.readline()
        elapsed = time.perf_counter() - start
        proc.kill()
        proc.wait()
        return elapsed
    proc.communicate()
    return time.perf_counter() - start


def run(quick: bool = False) -> dict:
    rounds = 1 if quick else 3
    with tempfile.TemporaryDirectory() as tmp:
        empty, typo, section = Path(tmp) / "empty.yaml", Path(tmp) / "typo.yaml", Path(tmp) / "section.yaml"
        empty.write_text("")
        section.write_text("trainr: {}\n")
        typo.write_text("trainer: {max_stepz: 10}\n")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "GLM_PROGRESS": "plain"}
        uncached = {**env, "XDG_CACHE_HOME": str(Path(tmp) / "cache")}
        cases = {
            "--help": (["--help"], env, False),
            "demo --help": (["demo", "--help"], env, False),
            "generate --help": (["generate", "--help"], env, False),
            "export --help": (["export", "--help"], env, False),
            "sweep --help": (["sweep", "--help"], env, False),
            "fit --help (cached)": (["fit", "--help"], env, False),
            "error: empty config file": (["fit", "--config", str(empty)], env, False),
            "error: generate bad value": (["generate", "--ckpt", "x.ckpt", "--num_samples", "0"], env, False),
            "error: key typo in a YAML section": (["fit", "--config", "configs/pretrain.yaml", "--config", str(typo)],
                                                  env, False),
            "error: misspelt section": (["fit", "--config", str(section)], env, False),
            "error: value of the wrong type": (["fit", "--config", "configs/pretrain.yaml",
                                                "--data.init_args.batch_size", "1.5"], env, False),
            "demo: first line": (["demo", "--dry-run"], env, True),
            "sweep: first line": (["sweep", "--config", "configs/experiments/ordering.yaml", "--dry-run"], env, True),
            "fit: first line": (["fit", "--config", "configs/pretrain.yaml", "--print_config"], env, True),
        }
        _time(["fit", "--help"], env)  # make sure the cache exists (as after `make venv`)
        rows = {name: statistics.median(_time(argv, e, first) for _ in range(rounds))
                for name, (argv, e, first) in cases.items()}
        rows["fit --help (uncached, once)"] = _time(["fit", "--help"], uncached)
    return {"seconds": rows, "target_s": TARGET_S, "rounds": rounds,
            "over_target": sorted(k for k, v in rows.items() if v >= TARGET_S)}


def main() -> None:
    from glm_lightning.machine import cpu_model

    res = run()
    print(f"CLI latency on {cpu_model()}, median of {res['rounds']} fresh processes (target < {TARGET_S:g} s)")
    for name, seconds in res["seconds"].items():
        print(f"  {name:<38}{seconds:7.2f} s  {'ok' if seconds < TARGET_S else 'OVER'}")


if __name__ == "__main__":
    main()
