"""Decode thresholds (glm_lightning/model/ops/thresholds.py): flash-25m cached generation, 16 samples x 48 new tokens
after a 64-token prompt, with SMALL_ROWS / SMALL_TOKENS as this CPU's table sets them and as the other kind of CPU's
(AVX-512: 32 / 64; AVX2: 0 / 0, BLAS always), alternated in one process; median tokens/s of the rounds. Below the
thresholds the few-row matmuls run as ``panel_matmul`` on weights packed for the decode (matmul.PANELS), or, in the
rows marked so, as ``small_matmul`` on the weights as stored. Beside the wall-clock rate, the rate in this process's
CPU time (``time.process_time``; one thread): on a machine shared with processes of the same priority, wall time also
counts the time the scheduler gave to others.

    python -m benchmarks.bench_decode_thresholds [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from glm_lightning.generation import generate
from glm_lightning.model import GLMConfig, GLMModel
from glm_lightning.model.ops import matmul, thresholds

SETTINGS = {"panel_matmul (32 / 64)": (32, 64, True), "small_matmul (32 / 64)": (32, 64, False),
            "BLAS (0 / 0)": (0, 0, False), "panels, SMALL_ROWS 0 only": (0, 64, True),
            "panels, SMALL_TOKENS 0 only": (32, 0, True)}
"""(SMALL_ROWS, SMALL_TOKENS, matmul.PANELS) per row of the table."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GLMModel(GLMConfig.preset("flash-25m")).eval()
    prompt = torch.randint(0, 256, (1, 64))
    shipped = (thresholds.SMALL_ROWS, thresholds.SMALL_TOKENS)
    panels = matmul.PANELS

    def run() -> None:
        generate(model, prompt, max_new_tokens=48, num_samples=16, temperature=1.0, eos_id=None,
                 generator=torch.Generator().manual_seed(0))

    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    cpu: dict[str, list[float]] = {name: [] for name in SETTINGS}
    try:
        for rows, tokens, matmul.PANELS in SETTINGS.values():  # warm-up
            thresholds.SMALL_ROWS, thresholds.SMALL_TOKENS = rows, tokens
            run()
        for _ in range(args.rounds):
            for name, (rows, tokens, matmul.PANELS) in SETTINGS.items():
                thresholds.SMALL_ROWS, thresholds.SMALL_TOKENS = rows, tokens
                t, c = time.perf_counter(), time.process_time()
                run()
                times[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
    finally:
        thresholds.SMALL_ROWS, thresholds.SMALL_TOKENS = shipped
        matmul.PANELS = panels
    print(f"cached generation, flash-25m, 16 x 48, {args.threads} thread(s), CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, shipped thresholds {shipped}, median of {args.rounds} rounds")
    print(f"{'(SMALL_ROWS, SMALL_TOKENS)':30s} {'tokens/s':>9s} {'per CPU s':>9s}  rounds (wall; CPU)")
    for name, ts in times.items():
        print(f"{name:30s} {16 * 48 / statistics.median(ts):9.0f} {16 * 48 / statistics.median(cpu[name]):9.0f}  "
              f"{', '.join(f'{16 * 48 / t:.0f}' for t in ts)}; {', '.join(f'{16 * 48 / t:.0f}' for t in cpu[name])}")


if __name__ == "__main__":
    main()
