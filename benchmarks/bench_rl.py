"""RL-sized generation and one tutorial-size RL epoch on flash-25m.

1. **RL-sized generation:** the tutorial's 96 prompts (increment, double, even x 32, rl split) x 16 samples x 48 new
   tokens at T = 0.35, every row in one prefill and one decode loop; generated tokens/s and peak RSS.
2. **Dropping finished rows:** the same engine with eos made likely (a logit bias, so lengths spread like a trained
   model's), finished rows dropped vs kept, alternated in one process; the tokens must be identical.
   **Each prompt once in the update:** policy forward + backward over G completions per prompt, full rows vs
   `grouped_completion_logprobs`, alternated.
3. **One RL epoch the size of the tutorial's run:** 96 prompts x G 16 in one `RLModule` step (one rollout call),
   <= 64 new tokens, sandboxed verifier scoring, and the policy update of the last block + final norm + untied head
   (the project's RL scope), through a real Lightning `Trainer`. Wall time split into generation, verifier,
   reference log-probs (0 without KL, as in the tutorial) and policy update.

The weights are random (no checkpoint is bundled), so no completion stops early (worst case for generation) and the
verifier rejects every one; the rewards are then replaced by seeded coin flips, so that every group is informative and
enters the update (the tutorial updated 73 of 96 groups): an upper bound on the update's cost.

    python -m benchmarks --only rl            (or: python -m benchmarks.bench_rl [--quick])
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import resource
import time
from typing import Any

import lightning.pytorch as pl
import torch

from callbacks.freeze import FreezeCallback
from datamodules.rl_prompts import RLPromptDataModule
from glm_lightning.evaluation import VerifierSettings, completion_finished
from glm_lightning.generation import generate
from glm_lightning.model import GLMConfig, GLMModel
from glm_lightning.model.model import GLMOutput
from glm_lightning.modules.rl import RLModule
from glm_lightning.rl.config import PolicyLoss, Sampling
from glm_lightning.rl.loss import build_sequences, completion_logprobs, grouped_completion_logprobs, pad_completions
from glm_lightning.tasks.task import make_tasks
from glm_lightning.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
FAMILIES = ["increment", "double", "even"]
TEMPERATURE = 0.35
TRAIN_SCOPE = ["model.blocks.11.*", "model.final_norm.*", "model.lm_head.*"]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rl_generation(model: GLMModel, per_family: int, samples: int, new_tokens: int) -> dict[str, Any]:
    """Every prompt x samples in one generate call, no early stop: generated tokens/s."""
    ids, valid = TOK.encode_batch([t.prompt for t in make_tasks("rl", per_family, FAMILIES)], bos=True)
    t = time.perf_counter()
    gen = generate(model, ids, max_new_tokens=new_tokens, temperature=TEMPERATURE, num_samples=samples, eos_id=None,
                   attention_mask=valid, generator=torch.Generator().manual_seed(0))
    seconds = time.perf_counter() - t
    n = int(gen.lengths.sum())
    return {"prompts": ids.shape[0], "samples": samples, "prompt_width": ids.shape[1], "new_tokens": new_tokens,
            "generated": n, "seconds": seconds, "tokens_per_s": n / seconds, "peak_rss_mb": peak_rss_mb()}


def compaction_ab(model: GLMModel, per_family: int, samples: int, new_tokens: int, reps: int) -> dict[str, Any]:
    """Finished rows dropped vs kept, alternated; eos made likely by a logit bias (p(eos) ~ 5% per token, so the
    mean length is about 20 of 48, as for a model that has learned to stop). Same seed, so the tokens must match."""
    bias = torch.zeros(model.cfg.vocab_size)
    bias[TOK.eos_id] = TEMPERATURE * math.log(0.05 * model.cfg.vocab_size / 0.95)  # near-uniform random logits
    hook = model.register_forward_hook(lambda m, args, out: GLMOutput(out.logits + bias, out.aux_loss))
    ids, valid = TOK.encode_batch([t.prompt for t in make_tasks("rl", per_family, FAMILIES)], bos=True)
    times: dict[bool, list[float]] = {True: [], False: []}
    outs = {}
    try:
        for _ in range(reps):
            for compact in (True, False):
                t = time.perf_counter()
                outs[compact] = generate(model, ids, max_new_tokens=new_tokens, temperature=TEMPERATURE,
                                         num_samples=samples, attention_mask=valid, compact=compact,
                                         generator=torch.Generator().manual_seed(0))
                times[compact].append(time.perf_counter() - t)
    finally:
        hook.remove()
    same = torch.equal(outs[True].tokens, outs[False].tokens)
    drop, keep = min(times[True]), min(times[False])
    return {"rows": ids.shape[0] * samples, "new_tokens": new_tokens,
            "mean_length": float(outs[True].lengths.float().mean()), "dropped_s": drop, "kept_s": keep,
            "speedup": keep / drop, "identical_tokens": same}


def update_ab(model: GLMModel, prompts: int, samples: int, new_tokens: int, reps: int) -> dict[str, Any]:
    """Policy forward + backward (last block + final norm + untied head trainable) over G completions per prompt:
    every full row teacher-forced (before) vs each prompt run once (`grouped_completion_logprobs`), alternated."""
    model.untie_head()
    for name, p in model.named_parameters():
        p.requires_grad_(any(fnmatch.fnmatch(f"model.{name}", pat) for pat in TRAIN_SCOPE))
    model.train()
    tasks = make_tasks("rl", prompts, FAMILIES)[:prompts]
    prompt_ids = [TOK.encode(t.prompt, bos=True) for t in tasks]
    gen = torch.Generator().manual_seed(0)
    comps = [torch.randint(0, 256, (int(n),), generator=gen).tolist()
             for n in torch.randint(new_tokens // 4, new_tokens + 1, (prompts * samples,), generator=gen)]
    ids, targets, mask = build_sequences([prompt_ids[i // samples] for i in range(len(comps))], comps)
    pids, pvalid = TOK.left_pad(prompt_ids)
    cids, cvalid = pad_completions(comps)
    times: dict[str, list[float]] = {"full": [], "grouped": []}
    lps = {}
    for _ in range(reps):
        for kind in ("full", "grouped"):
            model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            if kind == "full":
                lp = completion_logprobs(model, ids, targets, TEMPERATURE)[0][mask]
            else:
                lp = grouped_completion_logprobs(model, pids, pvalid, cids, cvalid, TEMPERATURE)[0][cvalid]
            lp.sum().backward()
            times[kind].append(time.perf_counter() - t)
            lps[kind] = lp.detach()
    full, grouped = min(times["full"]), min(times["grouped"])
    return {"rows": len(comps), "tokens_full": int(ids.numel()), "tokens_grouped": int(pids.numel() + cids.numel()),
            "full_s": full, "grouped_s": grouped, "speedup": full / grouped,
            "max_logp_diff": float((lps["full"] - lps["grouped"]).abs().max())}


def rl_epoch(per_family: int, group_size: int, new_tokens: int, micro_batch: int, kl_coef: float) -> dict[str, Any]:
    """One RLModule step over all prompts (= one epoch), timed by the module's own step timers."""
    torch.manual_seed(0)
    module = RLModule(preset="flash-25m", lr=5e-5, min_lr_ratio=1.0, warmup_steps=0, weight_decay=0.0,
                      sampling=Sampling(group_size=group_size, temperature=TEMPERATURE,
                                        max_new_tokens=new_tokens, seed=31415),
                      loss=PolicyLoss(kl_coef=kl_coef), verifier=VerifierSettings(workers=2, timeout_s=2.0),
                      micro_batch_size=micro_batch, log_samples_every_n_steps=0)
    real_rewards, coins = module.rewards, torch.Generator().manual_seed(1)
    verified: dict[str, Any] = {}

    def coin_rewards(rollouts, verdicts):  # random weights solve nothing: make every group informative
        verified["rewards"] = real_rewards(rollouts, verdicts)
        return torch.randint(0, 2, (len(rollouts.tasks), rollouts.group_size), generator=coins).float()

    module.rewards = coin_rewards
    n_prompts = per_family * len(FAMILIES)
    data = RLPromptDataModule(train_families=FAMILIES, monitor_families=[], prompts_per_family=per_family,
                              eval_per_family=1, batch_size=n_prompts, epochs=1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[FreezeCallback(train=TRAIN_SCOPE)])
    t = time.perf_counter()
    trainer.fit(module, datamodule=data)
    wall = time.perf_counter() - t
    m = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("time/", "train/"))}
    parts = {"generation_s": m["time/generate_s"], "verifier_s": m["time/verify_s"],
             "ref_logprobs_s": m.get("time/ref_logprobs_s", 0.0), "policy_update_s": m.get("time/policy_s", 0.0)}
    return {"prompts": n_prompts, "group_size": group_size, "max_new_tokens": new_tokens, "micro_batch": micro_batch,
            "kl_coef": kl_coef, "wall_s": wall, **parts,
            "other_s": wall - sum(parts.values()), "completion_len": m["train/completion_len"],
            "groups_updated": m["train/groups_updated"],
            "real_pass_rate": float((verified["rewards"] == 1).float().mean()),
            "trainable_params": sum(p.numel() for p in module.parameters() if p.requires_grad),
            "peak_rss_mb": peak_rss_mb()}


def run(quick: bool = False, kl_coef: float = 0.0) -> dict[str, Any]:
    per_family, samples = (4, 4) if quick else (32, 16)
    torch.manual_seed(0)
    model = GLMModel(GLMConfig.preset("flash-25m")).eval()
    gen = rl_generation(model, per_family, samples, 16 if quick else 48)
    print(f"RL-sized generation, flash-25m: {gen['prompts']} prompts x {samples} samples x {gen['new_tokens']} new "
          f"tokens (prompt width {gen['prompt_width']}): {gen['tokens_per_s']:.0f} generated tok/s "
          f"({gen['seconds']:.1f} s), peak RSS {gen['peak_rss_mb']:.0f} MB", flush=True)
    ab = compaction_ab(model, 2 if quick else 4, samples, 16 if quick else 48, reps=2)
    print(f"drop finished rows: {ab['rows']} rows, mean length {ab['mean_length']:.1f} of {ab['new_tokens']}: "
          f"kept {ab['kept_s']:.2f} s, dropped {ab['dropped_s']:.2f} s, {ab['speedup']:.2f}x, identical tokens: "
          f"{ab['identical_tokens']}", flush=True)
    up = update_ab(model, 2 if quick else 4, samples, 16 if quick else 64, reps=2)
    print(f"policy forward+backward, {up['rows']} rows: full rows {up['full_s']:.2f} s ({up['tokens_full']} tokens), "
          f"each prompt once {up['grouped_s']:.2f} s ({up['tokens_grouped']} tokens), {up['speedup']:.2f}x, "
          f"max |logp diff| {up['max_logp_diff']:.1e}", flush=True)
    del model
    ep = rl_epoch(per_family, samples, 16 if quick else 64, micro_batch=16 if quick else 64, kl_coef=kl_coef)
    print(f"RL epoch, {ep['prompts']} prompts x G {ep['group_size']}, <= {ep['max_new_tokens']} new tokens, "
          f"{ep['trainable_params']:,} trainable params: {ep['wall_s']:.0f} s wall = generation "
          f"{ep['generation_s']:.0f} s + verifier {ep['verifier_s']:.1f} s + reference log-probs "
          f"{ep['ref_logprobs_s']:.0f} s + policy update {ep['policy_update_s']:.0f} s + other {ep['other_s']:.0f} s; "
          f"peak RSS {ep['peak_rss_mb']:.0f} MB", flush=True)
    return {"generation": gen, "compaction": ab, "update": up, "epoch": ep, "peak_rss_mb": peak_rss_mb()}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--kl-coef", type=float, default=0.0, help="> 0 adds the frozen reference model's log-probs")
    a = p.parse_args()
    run(a.quick, a.kl_coef)
