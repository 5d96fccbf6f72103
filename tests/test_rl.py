"""RL stage: reward/advantage/loss math on hand-made inputs, the sign of one policy-gradient step, config errors,
fast_dev_run through the CLI, and a short real run (freezing, untied head, KL, PPO epochs, logs, rollout file)."""

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from callbacks.freeze import FreezeCallback
from callbacks.pass_at_k import PassAtKCallback
from callbacks.regression import RegressionCallback
from datamodules.rl_prompts import RLPromptDataModule
from glm_lightning.cli import main
from glm_lightning.evaluation import VerifierSettings
from glm_lightning.model import GLMConfig, GLMModel
from glm_lightning.modules.rl import RLModule
from glm_lightning.rl.config import PolicyLoss, Reward, Sampling
from glm_lightning.rl.loss import (
    aggregate_loss,
    build_sequences,
    completion_logprobs,
    compute_advantages,
    grouped_completion_logprobs,
    pad_completions,
    token_losses,
    verdict_reward,
)
from glm_lightning.tasks import make_tasks
from glm_lightning.tasks.task import record_task, task_record
from glm_lightning.tokenizer import ByteTokenizer
from glm_lightning.verifier import Verdict

CONF = str(Path(__file__).parent / "conf" / "rl_tiny.yaml")
TOK = ByteTokenizer()


# --- rewards and advantages ------------------------------------------------------------------------------------------
def test_verdict_rewards():
    passed, failed = Verdict("passed", 3, 3), Verdict("failed", 1, 3)
    assert verdict_reward(passed) == 1.0 and verdict_reward(failed) == 0.0
    assert verdict_reward(failed, "partial") == pytest.approx(1 / 3)
    for status in ("invalid", "timeout", "error"):
        assert verdict_reward(Verdict(status, 0, 3), invalid_penalty=-1.0) == -1.0
    assert verdict_reward(failed, format_bonus=0.1) == pytest.approx(0.1)
    assert verdict_reward(failed, format_bonus=0.1, truncated=True) == 0.0
    assert verdict_reward(Verdict("invalid", 0, 3), format_bonus=0.1, invalid_penalty=0.0) == 0.0
    assert math.isnan(verdict_reward(None))


def test_advantages_on_hand_made_groups():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [2.0, 0.0, 1.0, -0.1]])
    rloo, keep = compute_advantages(r, "rloo")
    assert keep.tolist() == [True, False, True]
    # leave-one-out: 1 - (0 + 0 + 1) / 3 = 2/3, 0 - 2/3
    assert torch.allclose(rloo[0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    assert torch.equal(rloo[1], torch.zeros(4))  # zero-variance group: skipped, no signal
    g3 = r[2]
    assert torch.allclose(rloo[2], torch.stack([g3[i] - (g3.sum() - g3[i]) / 3 for i in range(4)]))
    dr, _ = compute_advantages(r, "dr_grpo")
    assert torch.allclose(dr[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert torch.allclose(rloo[keep], dr[keep] * 4 / 3)  # RLOO = G/(G-1) x Dr. GRPO
    grpo, _ = compute_advantages(r, "grpo", eps=1e-4)
    std = r[0].std()  # Bessel-corrected
    assert torch.allclose(grpo[0], (r[0] - 0.5) / (std + 1e-4))
    assert torch.allclose(grpo[2].sum(), torch.tensor(0.0), atol=1e-6)
    # unscorable samples (NaN) are left out of the baseline and get advantage 0
    nan = torch.tensor([[1.0, float("nan"), 0.0], [float("nan"), 1.0, float("nan")]])
    a, keep = compute_advantages(nan, "rloo")
    assert keep.tolist() == [True, False]
    assert torch.allclose(a[0], torch.tensor([1.0, 0.0, -1.0])) and torch.equal(a[1], torch.zeros(3))
    with pytest.raises(ValueError, match="unknown advantage"):
        compute_advantages(r, "ppo")


def test_token_losses_clip_and_kl():
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.25, 0.5]]))  # ratio 2 on token 0, 1 on token 1
    loss, clipped, kl = token_losses(logp, old, torch.tensor([1.0]), clip_eps=0.2)
    assert torch.allclose(loss, torch.tensor([[-1.2, -1.0]]))  # positive advantage: ratio capped at 1 + eps
    assert clipped.tolist() == [[True, False]] and torch.equal(kl, torch.zeros_like(kl))
    loss, clipped, _ = token_losses(logp, old, torch.tensor([-1.0]), clip_eps=0.2, clip_eps_high=0.28)
    assert torch.allclose(loss, torch.tensor([[2.0, 1.0]])) and not clipped.any()  # pessimistic bound unclipped
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    _, _, kl = token_losses(logp, logp, torch.tensor([0.0]), ref_logp=ref, kl_coef=0.1)
    d = math.log(0.5)
    assert kl[0, 0].item() == pytest.approx(math.exp(d) - d - 1) and kl[0, 1].item() == pytest.approx(0.0)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    per_tok = torch.tensor([[1.0, 3.0, 100.0], [5.0, 100.0, 100.0]])
    assert aggregate_loss(per_tok, mask, "token", 3).item() == pytest.approx(3.0)
    assert aggregate_loss(per_tok, mask, "sequence", 2).item() == pytest.approx(3.5)


def test_policy_gradient_step_moves_logprobs_by_advantage_sign():
    torch.manual_seed(0)
    model = GLMModel(GLMConfig.preset("tiny", max_seq_len=192))
    task = make_tasks("rl", 1, ["increment"])[0]
    prompt = TOK.encode(task.prompt, bos=True)
    comps = [TOK.encode("\n    return x + 1\n"), TOK.encode("\n    return x * 2\n", eos=True)]
    ids, targets, mask = build_sequences([prompt, prompt], comps)
    assert mask.sum(1).tolist() == [len(c) for c in comps]

    def seq_logps(m):
        with torch.no_grad():
            lp, _, _ = completion_logprobs(m, ids, targets, temperature=0.7)
        return (lp * mask).sum(1)

    rewards = torch.tensor([[1.0, 0.0]])
    for estimator in ("rloo", "grpo", "dr_grpo"):  # same signs for every estimator
        adv, keep = compute_advantages(rewards, estimator)
        assert keep.all() and adv[0, 0] > 0 > adv[0, 1]
    for aggregation in ("token", "sequence"):
        for row in (0, 1):  # one optimizer step on each sample's share of the loss, from the same start
            m = copy.deepcopy(model)
            opt = torch.optim.SGD(m.parameters(), lr=0.01)
            before = seq_logps(m)
            lp, _, _ = completion_logprobs(m, ids, targets, temperature=0.7)
            tok, _, _ = token_losses(lp, lp.detach(), adv.flatten())
            only = mask.clone()
            only[1 - row] = False
            norm = float(only.sum()) if aggregation == "token" else 1.0
            aggregate_loss(tok, only, aggregation, norm).backward()
            opt.step()
            change = (seq_logps(m) - before)[row]
            assert change * adv[0, row] > 0, (aggregation, row, change)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_grouped_logprobs_equal_full_rows(mode):
    """Each prompt run once, its G completions continued from the replicated cache: the same log-probs, entropies
    and trainable-parameter gradients as teacher-forcing every full row (ragged prompts and completions)."""
    torch.manual_seed(0)
    model = GLMModel(GLMConfig.preset("tiny", max_seq_len=64))
    model.untie_head()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(("blocks.3.", "final_norm.", "lm_head.")))
    getattr(model, mode)()
    prompts = [TOK.encode("def f(x):", bos=True), TOK.encode("# a longer prompt\ndef g(value):", bos=True)]
    g = 3
    comps = [torch.randint(0, 256, (n,)).tolist() for n in (1, 7, 19, 4, 12, 2)]
    ids, targets, mask = build_sequences([prompts[i // g] for i in range(len(comps))], comps)
    pids, pvalid = TOK.left_pad(prompts)
    cids, cvalid = pad_completions(comps)
    full, grouped = copy.deepcopy(model), copy.deepcopy(model)
    lp, ent, _ = completion_logprobs(full, ids, targets, 0.7)
    glp, gent, _ = grouped_completion_logprobs(grouped, pids, pvalid, cids, cvalid, 0.7)
    assert torch.allclose(lp[mask], glp[cvalid], atol=1e-5) and torch.allclose(ent[mask], gent[cvalid], atol=1e-4)
    weights = torch.randn(int(mask.sum()))
    (lp[mask] * weights).sum().backward()
    (glp[cvalid] * weights).sum().backward()
    pairs = list(zip(full.parameters(), grouped.parameters()))
    assert all((a.grad is None) == (b.grad is None) for a, b in pairs)
    trained = [(a, b) for a, b in pairs if a.grad is not None]
    assert len(trained) >= 10 and all(a.requires_grad for a, _ in trained)  # the mixer, MoE, norms and head
    for a, b in trained:
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4)


# --- bad input -------------------------------------------------------------------------------------------------------
def test_bad_config_errors(tmp_path):
    tiny = {"preset": "tiny", "model_overrides": {"max_seq_len": 192}}
    with pytest.raises(ValueError, match="group_size"):
        Sampling(group_size=1)
    with pytest.raises(ValueError, match="unknown reward"):
        Reward(kind="accuracy")
    with pytest.raises(ValueError, match="unknown advantage"):
        PolicyLoss(advantage="ppo")
    with pytest.raises(ValueError, match="loss_aggregation"):
        PolicyLoss(aggregation="mean")
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=1.5)
    with pytest.raises(ValueError, match="micro_batch_size"):
        RLModule(**tiny, micro_batch_size=0)
    with pytest.raises(ValueError, match="unknown task family"):
        RLPromptDataModule(train_families=["increment", "fizzbuzz"])
    with pytest.raises(ValueError, match="unknown task family"):
        RLPromptDataModule(monitor_families=["nope"])
    with pytest.raises(ValueError, match="both rewarded and monitored"):
        RLPromptDataModule(train_families=["increment"], monitor_families=["increment", "square"])
    with pytest.raises(ValueError, match="eval_split"):
        RLPromptDataModule(eval_split="rl")
    with pytest.raises(ValueError, match="unknown task family"):
        PassAtKCallback(families=["nope"])
    with pytest.raises(ValueError, match="n = 4 samples"):
        PassAtKCallback(n=4, ks=[1, 8])
    with pytest.raises(ValueError, match="unknown task family"):
        RegressionCallback(families=["nope"])
    # a checkpoint of a different model config is refused at construction time
    other = GLMModel(GLMConfig.preset("tiny", max_seq_len=192, d_model=48))
    ckpt = tmp_path / "other.ckpt"
    torch.save({"glm_config": other.cfg.to_dict(),
                "state_dict": {f"model.{k}": v for k, v in other.state_dict().items()}}, ckpt)
    with pytest.raises(ValueError, match="different model config"):
        RLModule(**tiny, init_weights=str(ckpt))
    with pytest.raises(ValueError, match="group_size"):
        main(["fit", "--config", CONF, "--model.init_args.sampling.group_size", "1"])


def test_init_weights_roundtrip_with_untied_head(tmp_path):
    tiny = {"preset": "tiny", "model_overrides": {"max_seq_len": 192}}
    torch.manual_seed(1)
    src = RLModule(**tiny, untie_head=True)
    with torch.no_grad():
        src.model.lm_head.weight.add_(1.0)  # the head now differs from the embedding
    ckpt = tmp_path / "rl.ckpt"
    state = {"glm_config": src.glm_config.to_dict(), "state_dict": src.state_dict()}
    torch.save(state, ckpt)
    dst = RLModule(**tiny, untie_head=False, init_weights=str(ckpt))  # the checkpoint's own head is restored
    assert dst.model.lm_head is not None
    assert torch.equal(dst.model.lm_head.weight, src.model.lm_head.weight)
    assert torch.equal(dst.model.embed.weight, src.model.embed.weight)


def test_datamodule_records_and_sharding():
    dm = RLPromptDataModule(train_families="increment,double", monitor_families=None, prompts_per_family=3,
                            eval_per_family=2, batch_size=2, epochs=2, seed=5)
    assert dm.train_families == ("increment", "double")
    assert len(dm.monitor_families) == 6 and "even" in dm.monitor_families
    for t in dm.prompt_tasks:
        assert record_task(task_record(t)) == t and t.split == "rl"
    evals = dm.eval_tasks()
    assert len(evals) == 2 * 8 and {t.split for t in evals} == {"dev"}
    batches = list(dm.train_dataloader())
    assert sum(len(b) for b in batches) == 2 * 6 and all(isinstance(r, dict) for b in batches for r in b)
    from datamodules.rl_prompts import PromptStream

    recs = [task_record(t) for t in dm.prompt_tasks]
    full = PromptStream(recs, 1, 0).order()
    shards = [list(PromptStream(recs, 1, 0, rank=r, world_size=2)) for r in range(2)]
    assert shards[0] + shards[1] != [] and sorted(map(str, shards[0] + shards[1])) == sorted(map(str, full))
    assert not {str(x) for x in shards[0]} & {str(x) for x in shards[1]}


# --- through Lightning ---------------------------------------------------------------------------------------------
def test_fast_dev_run_cli(tmp_path):
    main(["fit", "--config", CONF, "--trainer.fast_dev_run", "1", "--trainer.default_root_dir", str(tmp_path)])


def _mixed_verdicts(self, rollouts):
    """Stand-in for the sandbox on an untrained model: alternate pass/fail so every group has reward variance."""
    return [Verdict("passed", 3, 3) if i % 2 == 0 else Verdict("failed", 1, 3) for i in range(len(rollouts.texts))]


def test_short_run_freezing_logs_and_rollouts(tmp_path, monkeypatch):
    monkeypatch.setattr(RLModule, "score", _mixed_verdicts)
    torch.manual_seed(0)
    module = RLModule(preset="tiny", model_overrides={"max_seq_len": 192}, lr=1e-2, min_lr_ratio=1.0, warmup_steps=0,
                      weight_decay=0.0,
                      sampling=Sampling(group_size=2, temperature=1.0, max_new_tokens=6),
                      loss=PolicyLoss(kl_coef=0.1, ppo_epochs=2), micro_batch_size=2,
                      verifier=VerifierSettings(workers=1), log_samples_every_n_steps=1)
    assert module.model.lm_head is not None and module.ref_model is not None
    before = {k: v.clone() for k, v in module.state_dict().items()}
    dm = RLPromptDataModule(train_families=["increment", "double"], monitor_families=["square"],
                            prompts_per_family=2, eval_per_family=1, batch_size=2)
    trainable = ["model.blocks.3.*", "model.final_norm.*", "model.lm_head.*"]
    trainer = Trainer(accelerator="cpu", max_steps=4, val_check_interval=2, num_sanity_val_steps=0,
                      log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, default_root_dir=tmp_path,
                      logger=TensorBoardLogger(tmp_path, name="rl", default_hp_metric=False),
                      callbacks=[FreezeCallback(trainable), PassAtKCallback(n=2, ks=[1, 2], max_new_tokens=6),
                                 RegressionCallback(max_new_tokens=6, n_boot=100)])
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 4  # 2 batches x 2 PPO epochs

    after = module.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    frozen_changed = {k for k in changed if not any(k.startswith(p[:-1]) for p in trainable)
                      and not k.endswith("load_counts")}  # load counts are non-persistent statistics
    assert not frozen_changed, sorted(frozen_changed)  # frozen weights, ref model, embedding: bit-identical
    assert "model.lm_head.weight" in changed and "model.embed.weight" not in changed
    assert any(k.startswith("model.blocks.3.") for k in changed)

    log_dir = Path(trainer.log_dir)
    rows = [json.loads(line) for line in (log_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2  # 2 steps x 2 prompts x G=2
    assert {"task_id", "completion", "reward", "advantage", "status"} <= set(rows[0])
    assert {r["reward"] for r in rows} == {0.0, 1.0}
    report = json.loads((log_dir / "regression_report.json").read_text())
    assert set(report["final"]["families"]) == {"increment", "double", "square"}
    assert (log_dir / "regression_report.md").read_text().startswith("# Regression report")

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/reward_mean", "train/reward_std", "train/pass_rate", "train/frac_reward_zero_std",
                "train/kl", "train/entropy", "train/completion_len", "train/clip_frac", "train/truncated_frac",
                "time/generate_s", "time/verify_s", "time/update_s", "time/ref_logprobs_s", "time/policy_s",
                "train/pass_rate/increment", "val/ref_nll",
                "val/pass@1", "val/pass@2", "val/greedy_pass", "val/pass@2/square", "val/greedy_pass/monitor",
                "regression/square/delta", "regression/flagged"):
        assert tag in tags, (tag, sorted(tags))
    assert [e.value for e in acc.Scalars("train/pass_rate")] == [0.5, 0.5]
    assert any(e.value > 0 for e in acc.Scalars("train/kl"))  # second PPO epoch moved away from the reference
    assert "samples/rollouts/text_summary" in acc.Tags()["tensors"]
