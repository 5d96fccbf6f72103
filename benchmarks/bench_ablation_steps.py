"""Seconds per training step of every arm of the ablation studies (configs/experiments/ablation_*.yaml), for their
equal wall-clock reading: a part that costs more time per step must beat the steps a cheaper variant could have taken
in the same minutes.

    python -m benchmarks.bench_ablation_steps [--rounds 7] [--steps 4] [--threads 1] [--write]

Each arm is the demo pre-training's model with the arm's `model_overrides` (arms that build the same model are timed
once), trained on the study's own batches (16 x 192 of the demo corpus): forward, loss + aux loss, backward, gradient
clipping, the fused AdamW step and the MoE balancing update, as a Lightning training step does. The arms take turns in
one process, `--steps` steps each per round after one warm-up round; the median over rounds is the arm's time, and
the spread (min-max of the per-round medians) says how steady the sitting was. Run it with nothing else on the
machine. `--write` saves the table to docs/results/data/ablation_step_times.json, which the studies' equal-time arms
take their step counts from (`equal_time_steps`; tests/test_ablation_studies.py checks that they agree). With
`--studies` naming some studies, `--write` replaces only their arms (each arm records when and at which commit it was
timed): a study's arms and its control are always timed in one sitting, and the studies already run keep the times
their equal-time arms were planned from.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

from glm_lightning.model import GLMConfig, GLMModel
from glm_lightning.optim import AdamW

REPO = Path(__file__).resolve().parents[1]
STUDIES = ("mhc", "mhc_2streams", "mixer", "moe", "indexer", "moe_25m", "mixer_25m", "mixer_avx512")
RESULTS = REPO / "docs" / "results" / "data" / "ablation_step_times.json"
EQUAL_TIME_SUFFIX = "_equal_time"


def study_arms(study: str) -> dict[str, dict[str, Any]]:
    """Arm name -> its model overrides, one per model a study builds: an `<arm>_equal_time` twin builds the same model
    as `<arm>`, under that name (a study may ask only the equal-time question of an arm: ablation_mixer_avx512.yaml)."""
    raw = yaml.safe_load((REPO / "configs" / "experiments" / f"ablation_{study}.yaml").read_text())
    arms: dict[str, dict[str, Any]] = {}
    for name, v in raw["variants"].items():
        arms.setdefault(name.removesuffix(EQUAL_TIME_SUFFIX), dict(v.get("model.init_args.model_overrides") or {}))
    return arms


def study_preset(study: str) -> str:
    """The model preset of an ablation study: its base config's `model.init_args.preset` (demo, or flash-25m for the
    confirmation at 25M)."""
    raw = yaml.safe_load((REPO / "configs" / "experiments" / f"ablation_{study}.yaml").read_text())
    base = yaml.safe_load((REPO / "configs" / "experiments" / raw["base"]).read_text())
    return str(base["model"]["init_args"].get("preset", "demo"))


def arm_key(overrides: dict[str, Any], preset: str = "demo") -> str:
    """One name per distinct model: the preset's config with the overrides applied, as sorted JSON."""
    return json.dumps(GLMConfig.preset(preset, **overrides).to_dict(), sort_keys=True)


def demo_batches(n: int) -> list[dict[str, torch.Tensor]]:
    """The first `n` training batches of the studies' base config (demo corpus, 16 x 192, seed 0)."""
    from datamodules import CodeCorpusDataModule

    base = yaml.safe_load((REPO / "configs" / "experiments" / "base_pretrain_demo.yaml").read_text())
    dm = CodeCorpusDataModule(**base["data"]["init_args"])
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(n)]


class Arm:
    """A model, its optimizer and a step that does what a pre-training step does."""

    def __init__(self, overrides: dict[str, Any], lr: float = 3e-3, preset: str = "demo") -> None:
        torch.manual_seed(0)
        self.model = GLMModel(GLMConfig.preset(preset, **overrides))
        self.opt = AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr)
        self.n_params = sum(p.numel() for p in self.model.parameters())

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        out = self.model(batch["input_ids"])
        loss = F.cross_entropy(out.logits.float().flatten(0, 1), batch["targets"].flatten(), ignore_index=-100)
        (loss + out.aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.model.update_balance_bias()


def measure(arms: dict[str, dict[str, Any]], rounds: int, steps: int,
            presets: dict[str, str] | None = None) -> dict[str, dict[str, float]]:
    """Median seconds per step of each arm over `rounds` alternated rounds of `steps` steps (after a warm-up); an arm
    builds `presets[name]` (default demo) with its overrides. Every preset trains on the same 16 x 192 batches."""
    batches = demo_batches(steps)
    built = {name: Arm(ov, preset=(presets or {}).get(name, "demo")) for name, ov in arms.items()}
    per_round: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(rounds + 1):
        order = list(built) if r % 2 == 0 else list(reversed(built))  # alternate who goes first
        for name in order:
            arm = built[name]
            t0 = time.perf_counter()
            for b in batches:
                arm.step(b)
            if r:  # round 0 warms caches and allocators
                per_round[name].append((time.perf_counter() - t0) / steps)
    return {name: {"seconds_per_step": statistics.median(v), "min": min(v), "max": max(v),
                   "params": built[name].n_params} for name, v in per_round.items()}


def variant_steps(study: Any, variant: Any) -> int:
    """A loaded study variant's optimizer steps: its own `trainer.max_steps`, else the study's, else its base config's
    (150 at the demo scale, 120 at 25M)."""
    base = yaml.safe_load(study.base.read_text())["trainer"]["max_steps"]
    return int(variant.overrides.get("trainer.max_steps", study.overrides.get("trainer.max_steps", base)))


def equal_time_steps(control_s: float, variant_s: float, control_steps: int) -> int:
    """Optimizer steps the variant takes in the control's wall-clock time for `control_steps` steps."""
    return max(1, round(control_steps * control_s / variant_s))


def run(studies: Sequence[str] = STUDIES, rounds: int = 7, steps: int = 4) -> dict[str, Any]:
    arms: dict[str, dict[str, Any]] = {}
    names: dict[str, str] = {}  # arm key -> the first "study/variant" that builds it
    members: dict[str, list[str]] = {}
    presets: dict[str, str] = {}
    for study in studies:
        preset = study_preset(study)
        for variant, ov in study_arms(study).items():
            key = arm_key(ov, preset)
            names.setdefault(key, f"{study}/{variant}")
            arms.setdefault(names[key], ov)
            presets.setdefault(names[key], preset)
            members.setdefault(names[key], []).append(f"{study}/{variant}")
    times = measure(arms, rounds, steps, presets)
    from glm_lightning.sweep.report import git_revision

    # each arm carries its sitting and its machine: equal-time steps hold only on the CPU that timed them
    sitting = {"git": git_revision(), "measured_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
               "torch_cpu": torch.backends.cpu.get_cpu_capability()}
    by_variant = {m: {**times[arm], "timed_as": arm, **sitting} for arm, ms in members.items() for m in ms}
    return {"by_variant": by_variant, **sitting, "rounds": rounds, "steps_per_round": steps,
            "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "torch_cpu": torch.backends.cpu.get_cpu_capability(), "load_before": os.getloadavg()[0]}


def merged(res: dict[str, Any], path: Path) -> dict[str, Any]:
    """`res` written over the saved table: the arms of the studies just timed replace theirs (all of each study's
    arms, so no study mixes two sittings); the other studies' arms stay as they were measured."""
    if not path.is_file():
        return res
    old = json.loads(path.read_text())
    timed = {k.split("/")[0] for k in res["by_variant"]}
    # an arm kept from an older sitting keeps that sitting's machine (the top-level fields become the new sitting's)
    machine = {k: old[k] for k in ("torch_cpu", "cpu", "threads") if k in old}
    kept = {k: {**machine, **v} for k, v in old.get("by_variant", {}).items() if k.split("/")[0] not in timed}
    return {**old, **{k: v for k, v in res.items() if k != "by_variant"}, "by_variant": {**kept, **res["by_variant"]}}


def table(res: dict[str, Any]) -> list[str]:
    lines = ["| arm | params | s/step (median) | min-max over rounds | vs the study's control |", "|---|---:|---:|---|---:|"]
    for study in STUDIES:
        arms = [k for k in res["by_variant"] if k.startswith(study + "/")]
        if not arms:
            continue
        raw = yaml.safe_load((REPO / "configs" / "experiments" / f"ablation_{study}.yaml").read_text())
        control = res["by_variant"][f"{study}/{raw['control']}"]["seconds_per_step"]
        for k in arms:
            r = res["by_variant"][k]
            lines.append(f"| {k} | {r['params']:,} | {r['seconds_per_step']:.4f} | {r['min']:.4f}-{r['max']:.4f} | "
                         f"{r['seconds_per_step'] / control:.2f}x |")
    return lines


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--studies", default=",".join(STUDIES))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--write", action="store_true", help=f"save to {RESULTS.relative_to(REPO)}")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    res = run([s for s in args.studies.split(",") if s], args.rounds, args.steps)
    print("\n".join(table(res)))
    print(f"\n{res['threads']} thread(s), {res['rounds']} rounds x {res['steps_per_round']} steps, torch CPU "
          f"capability {res['torch_cpu']}, load before {res['load_before']:.2f}")
    if args.write:
        RESULTS.write_text(json.dumps(merged(res, RESULTS), indent=1) + "\n")
        print(f"wrote {RESULTS.relative_to(REPO)}")
    return res


if __name__ == "__main__":
    main()
