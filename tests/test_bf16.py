"""bf16 on the CPU (README, "Precision"): ``--trainer.precision bf16-mixed`` trains every stage with fp32 master
weights and optimizer states, the GEMMs in bf16, attention and every other op in fp32 (the C++ ops see fp32, except
the MoE's SwiGLU and row moves, which take bf16 with fp32 math: tests/test_moe.py); the emulated
bf16 GEMM agrees with torch's native bf16 kernel; generation samples from a bf16 copy of the weights."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from glm_lightning import precision
from glm_lightning.generation import generate, generate_naive, sampling_weights
from glm_lightning.model import GLMConfig, GLMModel, cext, ops
from glm_lightning.model.ops import mixed_precision as mp
from glm_lightning.modules.rl import RLModule
from glm_lightning.rl.loss import grouped_completion_logprobs, pad_completions
from glm_lightning.stage_cli import build_cli
from glm_lightning.sweep import load_study, run_sweep
from glm_lightning.tokenizer import ByteTokenizer
from glm_lightning.verifier import Verdict

CONF = Path(__file__).parent / "conf"
ROOT = Path(__file__).resolve().parent.parent
TOK = ByteTokenizer()
CPP_OPS = sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("glm_lightning::"))


# --- detection ----------------------------------------------------------------------------------------------------
def test_native_bf16_detected_from_the_cpuinfo_flags(tmp_path):
    """avx512_bf16 or amx_bf16 in the flags line: native; neither, or no readable cpuinfo: not native."""
    native = tmp_path / "native"
    native.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n\nprocessor\t: 1\n")
    amx = tmp_path / "amx"
    amx.write_text("flags\t\t: avx2 amx_tile amx_bf16\n")
    plain = tmp_path / "plain"
    plain.write_text("flags\t\t: fpu sse avx2 fma\n")
    assert precision.native_flag(precision.cpu_flags(native)) == "avx512_bf16"
    assert precision.native_flag(precision.cpu_flags(amx)) == "amx_bf16"
    assert precision.native_flag(precision.cpu_flags(plain)) is None
    assert precision.cpu_flags(tmp_path / "missing") is None and precision.native_flag(None) is None
    line = precision.describe()
    assert line.startswith("bf16: native (") if precision.native_bf16() else line.startswith("bf16: not native (")



def test_bf16_gemm_kernel_follows_the_detection_unless_the_environment_says(monkeypatch):
    """GLM_LIGHTNING_BF16_GEMM=native|emulated overrides the detection (auto or unset: native only where the CPU has
    native bf16); another value is a clear error."""
    expected = {"native": "native", "emulated": "emulated", "auto": "native" if precision.native_bf16() else "emulated",
                "": "native" if precision.native_bf16() else "emulated"}
    try:
        for value, mode in expected.items():
            monkeypatch.setenv(mp.ENV, value)
            mp._detected_mode.cache_clear()
            assert mp.gemm_mode() == mode
        monkeypatch.setenv(mp.ENV, "fastest")
        mp._detected_mode.cache_clear()
        with pytest.raises(ValueError, match="GLM_LIGHTNING_BF16_GEMM='fastest'"):
            mp.gemm_mode()
    finally:
        monkeypatch.undo()
        mp._detected_mode.cache_clear()


# --- the emulated GEMM against torch's native bf16 kernel ---------------------------------------------------------
ULP = 2.0 ** -7
"""A bf16 ulp relative to the value (8 significant bits): the two kernels sum in different orders, so a rounded output
may differ by one ulp."""


def _one_ulp_apart(a: torch.Tensor, b: torch.Tensor) -> None:
    a, b = a.detach().float(), b.detach().float()
    scale = torch.maximum(a.abs(), b.abs())
    assert bool(((a - b).abs() <= ULP * scale + 1e-6).all()), float(((a - b).abs() / scale.clamp_min(1e-6)).max())


@pytest.mark.parametrize("op", ["linear", "bmm", "attention"])
def test_emulated_bf16_gemm_agrees_with_the_native_kernel(op):
    """Outputs and grads of a bf16 linear layer (autocast), a bmm and an attention within one bf16 ulp of torch's own
    bf16 kernels (slow here; small shapes); and the emulated outputs are bf16-rounded values (bf16 dtype). Attention
    runs torch's fp32 kernel in both modes (mixed_precision.attention): compared with torch's bf16 SDPA."""
    gen = torch.Generator().manual_seed(0)
    if op == "linear":
        args = [torch.randn(2, 24, 48, generator=gen), torch.randn(40, 48, generator=gen) * 0.2,
                torch.randn(40, generator=gen)]
    elif op == "bmm":
        args = [torch.randn(3, 20, 36, generator=gen), torch.randn(3, 36, 28, generator=gen)]
    else:
        args = [torch.randn(2, 2, 16, 8, generator=gen) for _ in range(3)]
    runs = {}
    for mode in mp.MODES:
        leaves = [a.clone().requires_grad_(True) for a in args]
        with mp.bf16_gemm(mode), torch.autocast("cpu", torch.bfloat16):
            if op == "linear":
                y = ops.linear(*leaves)
            elif op == "bmm":
                y = mp.bmm(*leaves)
            elif mode == "native":  # torch's own bf16 SDPA
                y = F.scaled_dot_product_attention(*(leaf.to(torch.bfloat16) for leaf in leaves), is_causal=True)
            else:
                y = ops.attention(*leaves, causal=True)
        assert y.dtype == torch.bfloat16
        with mp.bf16_gemm(mode):
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype))
        runs[mode] = (y, [leaf.grad for leaf in leaves])
    pairs = [(runs["emulated"][0].detach(), runs["native"][0].detach())] + list(zip(runs["emulated"][1],
                                                                                     runs["native"][1]))
    for i, (emu, nat) in enumerate(pairs):
        assert i == 0 or emu.dtype == nat.dtype == torch.float32  # grads reach the fp32 leaves in fp32
        if op == "attention":
            # torch's bf16 kernel rounds q, k, v and the probabilities to bf16 (ours keeps them fp32): measured at
            # most 1 ulp of the tensor's largest value
            torch.testing.assert_close(emu.float(), nat.float(), rtol=ULP, atol=2 * ULP * float(nat.abs().max()))
        else:
            _one_ulp_apart(emu, nat)


def test_attention_under_bf16_is_the_fp32_kernel_rounded_once():
    """Under autocast (either GEMM mode) attention is torch's fp32 SDPA on the operands' values, its output rounded
    to bf16, and the grads of fp32 leaves the fp32 kernel's grads of that rounded output's grad: bit for bit."""
    gen = torch.Generator().manual_seed(2)
    args = [torch.randn(2, 3, 12, 8, generator=gen) for _ in range(3)]
    dy = torch.randn(2, 3, 12, 8, generator=gen).to(torch.bfloat16)
    ref_leaves = [a.clone().requires_grad_(True) for a in args]
    ref = F.scaled_dot_product_attention(*ref_leaves, is_causal=True)
    ref.backward(dy.float())
    for mode in mp.MODES:
        leaves = [a.clone().requires_grad_(True) for a in args]
        with mp.bf16_gemm(mode), torch.autocast("cpu", torch.bfloat16):
            y = ops.attention(*leaves, causal=True)
        y.backward(dy)
        assert y.dtype == torch.bfloat16 and torch.equal(y, ref.detach().to(torch.bfloat16))
        for leaf, want in zip(leaves, ref_leaves):
            assert torch.equal(leaf.grad, want.grad)


def test_fp32_ops_cast_bf16_inputs_at_their_boundary():
    """An fp32 op given bf16 tensors (or run under autocast) computes exactly what it computes on their fp32 values."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 4, 4, generator=gen).to(torch.bfloat16)
    want = ops.sinkhorn(logits.float(), 20, 1e-6)
    got = ops.sinkhorn(logits, 20, 1e-6)
    with torch.autocast("cpu", torch.bfloat16):
        got_autocast = ops.sinkhorn(logits, 20, 1e-6)
    assert got.dtype == got_autocast.dtype == torch.float32
    assert torch.equal(got, want) and torch.equal(got_autocast, want)


# --- bf16-mixed training in every stage ---------------------------------------------------------------------------
class _Watch(pl.Callback):
    """The loss of every step (the stage's logged ``train/loss``) and the dtypes of the parameters and optimizer
    states after each step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.dtypes: set[torch.dtype] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs  # RL logs it (when a group updated)
        loss = trainer.callback_metrics.get("train/loss") if loss is None else loss
        if loss is not None:
            self.losses.append(float(loss))
        self.dtypes |= {p.dtype for p in pl_module.parameters()}
        for opt in trainer.optimizers:
            self.dtypes |= {v.dtype for state in opt.state.values() for v in state.values()
                            if isinstance(v, torch.Tensor) and v.is_floating_point()}


BF16_CPP_OPS = {"swiglu", "swiglu_backward", "rows_scatter", "rows_gather_sum", "rows_dot", "rows_scatter_dot"}
"""The C++ ops that take bf16 (the MoE's activation and row moves between its bf16 GEMMs; fp32 math inside)."""


def _spy_cpp_ops(monkeypatch) -> list[str]:
    """Record every floating input dtype other than fp32 that reaches a C++ op (each op wrapped in place), other than
    bf16 into the ops of BF16_CPP_OPS and panel_matmul's packed weights (bf16 panels are the bf16 sampling copy's
    decode weights, widened in the kernel)."""
    bad: list[str] = []
    for name in CPP_OPS:
        real = getattr(torch.ops.glm_lightning, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            inputs = [a for i, a in enumerate((*args, *kwargs.values())) if not (_name == "panel_matmul" and i == 1)]
            bad.extend(f"{_name}: {a.dtype}" for a in inputs
                       if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != torch.float32
                       and not (a.dtype == torch.bfloat16 and _name in BF16_CPP_OPS))
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch.ops.glm_lightning, name, spy)
    return bad


def _fit(conf: str, precision: str, steps: int, tmp_path: Path, *extra: str) -> _Watch:
    cli = build_cli(["--config", str(CONF / conf), "--trainer.precision", precision,
                     "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0",
                     "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
                     "--trainer.default_root_dir", str(tmp_path), *extra], run=False)
    watch = _Watch()
    cli.trainer.callbacks.append(watch)
    gemms: list[int] = []
    real = mp._bf16_gemm
    mp._bf16_gemm = lambda *a, **k: gemms.append(1) or real(*a, **k)
    try:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    finally:
        mp._bf16_gemm = real
    watch.bf16_gemms = len(gemms)
    return watch


STAGES = {"pretrain": ("pretrain_tiny.yaml", 2e-3, ("--trainer.gradient_clip_val", "1.0")),
          "vision": ("vision_tiny.yaml", 2e-3, ("--trainer.gradient_clip_val", "1.0")),
          "rl": ("rl_tiny.yaml", None, ("--model.init_args.sampling.precision", "bf16"))}
"""Each stage's tiny config, the tolerance on its step-0 loss against fp32 (relative) and its clipping (the stage
configs clip at 1.0): measured 1.6e-4 (pre-training, 5.7466 vs 5.7456) and 1.2e-4 (vision, 5.7134 vs 5.7127), so
2e-3 is ~10x the measured gap. RL's step-0 loss depends on the sampled rollouts, which bf16 changes: only its
finiteness is checked (the log-prob agreement has its own test); its rollouts sample from the bf16 copy."""


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_bf16_mixed_fit_keeps_fp32_masters_and_fp32_reductions(stage, tmp_path, monkeypatch):
    """Two steps with --trainer.precision bf16-mixed: parameters and AdamW states stay fp32, the GEMMs ran in bf16,
    no C++ op but the MoE's activation and row moves saw a bf16 input (norms, Sinkhorn, KDA, routing reduce in fp32),
    the loss is finite and its first value
    within the stated tolerance of fp32's."""
    conf, tol, clip = STAGES[stage]
    if stage == "rl":  # an untrained model fails every task: alternate verdicts so that every group updates
        monkeypatch.setattr(RLModule, "score", lambda self, r: [Verdict("passed", 3, 3) if i % 2 == 0 else
                                                               Verdict("failed", 1, 3) for i in range(len(r.texts))])
    autocast_in_backward: list[bool] = []
    if stage == "rl":  # manual optimization: backward is called inside training_step, where autocast is on
        real_backward = RLModule.manual_backward
        monkeypatch.setattr(RLModule, "manual_backward", lambda self, loss, *a, **kw: autocast_in_backward.append(
            torch.is_autocast_enabled("cpu")) or real_backward(self, loss, *a, **kw))
    refreshed: list[int] = []
    if stage == "rl":  # the bf16 sampling copy is told of every optimizer step, whatever the optimizer
        from glm_lightning.modules import rl as rl_module
        real_changed = rl_module.weights_changed
        monkeypatch.setattr(rl_module, "weights_changed", lambda m: refreshed.append(1) or real_changed(m))
    bad = _spy_cpp_ops(monkeypatch) if cext.available() else []
    bf16 = _fit(conf, "bf16-mixed", 2, tmp_path / "bf16", *clip)
    assert len(refreshed) == (2 if stage == "rl" else 0)
    assert autocast_in_backward == [] if stage != "rl" else (autocast_in_backward and not any(autocast_in_backward))
    assert len(bf16.losses) == 2 and all(map(torch.isfinite, map(torch.tensor, bf16.losses))), bf16.losses
    assert bf16.dtypes == {torch.float32}, bf16.dtypes
    assert bf16.bf16_gemms > 20
    assert not bad, sorted(set(bad))
    if tol is not None:
        fp32 = _fit(conf, "32-true", 1, tmp_path / "fp32", *clip)
        assert fp32.bf16_gemms == 0
        assert abs(bf16.losses[0] - fp32.losses[0]) <= tol * abs(fp32.losses[0]), (bf16.losses[0], fp32.losses[0])


def _tiny(**kw) -> GLMModel:
    torch.manual_seed(0)
    return GLMModel(GLMConfig.preset("tiny", **kw))


def test_whole_model_forward_under_autocast_is_close_to_fp32():
    """Logits of a tiny model (the DSA layer past its top-k: sparse) under bf16 autocast against fp32: at most 0.05
    apart (measured 0.029 with logits up to 0.6; bf16's ulp at 0.5 is 0.004, and each of the 4 layers' GEMMs rounds),
    the mean gap 5x smaller, and the same greedy choice at 95% or more of the positions (measured 100%)."""
    model = _tiny()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fp32 = model(ids).logits
        with torch.autocast("cpu", torch.bfloat16):
            bf16 = model(ids).logits
    assert bf16.dtype == torch.bfloat16
    gap = (bf16.float() - fp32).abs()
    assert float(gap.max()) < 0.05 and float(gap.mean()) < 0.01, (float(gap.max()), float(gap.mean()))
    assert float((bf16.float().argmax(-1) == fp32.argmax(-1)).float().mean()) >= 0.95


# --- generation from bf16 weights -----------------------------------------------------------------------------------
def test_cached_generation_with_bf16_weights_equals_uncached(monkeypatch):
    """precision="bf16": the sampling copy's matrices hold bf16 values (fp32 storage), its vectors are the model's,
    its caches fp32, its decode packs bf16 panels, and cached greedy decoding (left-padded prompts, the DSA layer past
    its top-k) gives the tokens of re-running the copy on the whole prefix. The decode's matmuls round their inputs
    to bf16 and the re-run's do not (README, "Precision"), so the logits differ by that rounding: the tokens agree
    while no step's top two logits are closer than it, as on this seed (a change to either path that moves logits by
    more than the rounding shows here)."""
    from glm_lightning.model.ops import matmul, thresholds

    monkeypatch.setattr(thresholds, "SMALL_ROWS", 32)  # the decode's linears on panels (AVX-512's table)
    monkeypatch.setattr(thresholds, "SMALL_TOKENS", 64)
    model = _tiny()
    copy16 = sampling_weights(model, "bf16")
    for p, q in zip(model.parameters(), copy16.parameters()):
        assert q.dtype == torch.float32
        assert torch.equal(q, p.to(torch.bfloat16).float() if p.dim() >= 2 else p)
    assert copy16.new_cache(1).packed.dtype == torch.bfloat16 and model.new_cache(1).packed.dtype == torch.float32
    panels = []
    real = matmul.panel_matmul
    monkeypatch.setattr(matmul, "panel_matmul", lambda *a: panels.append(a[1].dtype) or real(*a))
    prompts = torch.randint(32, 127, (3, 14), generator=torch.Generator().manual_seed(1))
    cached = generate(model, prompts, max_new_tokens=24, eos_id=None, precision="bf16")
    if cext.available():  # the panels are the C++ library's; without it the decode's linears are torch's, in fp32
        assert panels and set(panels) == {torch.bfloat16}
    assert torch.equal(cached.tokens, generate_naive(copy16, prompts, max_new_tokens=24, eos_id=None))
    assert sampling_weights(model, "bf16") is copy16  # kept while the weights are unchanged


def test_bf16_sampling_copy_follows_the_weights():
    """After a parameter changes (an optimizer step), the next generation samples from refreshed bf16 weights."""
    model = _tiny()
    copy16 = sampling_weights(model, "bf16")
    before = copy16.embed.weight.clone()
    with torch.no_grad():
        model.embed.weight.mul_(2.0)
    again = sampling_weights(model, "bf16")
    assert torch.equal(again.embed.weight, model.embed.weight.to(torch.bfloat16).float())
    assert not torch.equal(again.embed.weight, before)


@pytest.mark.parametrize("optimizer", ["project", "torch-fused"])
def test_bf16_sampling_copy_follows_an_optimizer_step(optimizer):
    """A fused AdamW kernel writes the weights without bumping their version counters: the project's AdamW bumps them
    itself, and after torch's fused AdamW `weights_changed` does (RL calls it after every step). Either way the next
    generation samples from the stepped weights, not the copy made before the step."""
    from glm_lightning.generation import weights_changed
    from glm_lightning.optim import AdamW

    model = _tiny()
    copy16 = sampling_weights(model, "bf16")
    stale = copy16.embed.weight.clone()
    opt = AdamW(model.parameters(), lr=0.1) if optimizer == "project" else \
        torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    model(torch.randint(0, 200, (2, 8))).logits.square().mean().backward()
    opt.step()
    if optimizer == "torch-fused":
        weights_changed(model)
    again = sampling_weights(model, "bf16")
    assert torch.equal(again.embed.weight, model.embed.weight.to(torch.bfloat16).float())
    assert not torch.equal(again.embed.weight, stale)


def test_rl_trainer_and_bf16_sampler_logprobs_agree_within_the_ppo_clip():
    """Rollouts sampled from the bf16 copy (temperature 1, 2 prompts x 4 samples x 24 tokens) and the log-probs the
    policy loss computes for the same tokens (fp32, and under bf16 autocast with the fp32 weights) agree within
    log(1.2) = 0.18 per token, the PPO clip range (ratios outside [0.8, 1.2] would be clipped), and within 0.03 on
    average. Measured on this tiny model (embedding scaled 8x so that its logits are far from uniform): max 0.115 and
    mean 0.014 (fp32), max 0.117 and mean 0.015 (bf16-mixed); with the weight-only bf16 copy (fp32 activations, bf16
    panels) max 0.114 and mean 0.015 (fp32), max 0.116 and mean 0.015 (bf16-mixed). The loss does not correct for the gap (its old
    log-probs are the trainer's own, RL's `train/logprob_gap` logs it)."""
    model = _tiny(max_seq_len=96)
    with torch.no_grad():
        model.embed.weight.mul_(8.0)
    prompts = [TOK.encode("def f(x):", bos=True), TOK.encode("# a longer prompt\ndef g(value):", bos=True)]
    ids, valid = TOK.left_pad(prompts)
    gen = generate(model, ids, max_new_tokens=24, temperature=1.0, num_samples=4, attention_mask=valid, eos_id=None,
                   generator=torch.Generator().manual_seed(0), precision="bf16")
    comps = [gen.tokens[r, : int(gen.lengths[r])].tolist() for r in range(gen.tokens.shape[0])]
    cids, cvalid = pad_completions(comps)
    sampler = gen.logprobs[:, : cids.shape[1]][cvalid]
    for mixed in (False, True):
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=mixed):
            trainer, _, _ = grouped_completion_logprobs(model, ids, valid, cids, cvalid, 1.0)
        gap = (trainer[cvalid] - sampler).abs()
        assert float(gap.max()) < math.log(1.2) and float(gap.mean()) < 0.03, (mixed, float(gap.max()),
                                                                               float(gap.mean()))


def test_bf16_parity_study_parses_and_every_variant_instantiates(tmp_path, capsys):
    """configs/experiments/bf16_parity.yaml: the study file, its base and both arms (fp32 control, bf16-mixed) pass
    the sweep's checks (parsed and instantiated by the stage CLI), 10 paired seeds, its two own questions (dev pass at
    +-5 points, val bpb at +-0.02) parse, nothing run."""
    study = load_study(ROOT / "configs" / "experiments" / "bf16_parity.yaml")
    assert study.control == "fp32" and len(study.seeds) == 10
    assert [(c.own, c.variant, c.metric, c.margin) for c in study.claims] == [(True, "bf16", None, 5.0),
                                                                              (True, "bf16", "val/bpb", 0.02)]
    run_sweep(["--config", str(ROOT / "configs" / "experiments" / "bf16_parity.yaml"), "--out", str(tmp_path),
               "--dry-run", "--seeds", "1"])
    text = capsys.readouterr().out
    assert "--trainer.precision=bf16-mixed" in text and "--trainer.precision=32-true" in text
    assert not (tmp_path / "bf16_parity").exists()


def test_training_step_emulated_agrees_with_native_bf16():
    """A whole training step of the tiny model under bf16 autocast (sparse DSA, MoE, mHC), emulated against torch's
    native bf16 kernels: the same loss within 1e-3 (relative) and every gradient within 5% of its largest entry
    (measured: loss 3.5e-6 apart, relative; the gradients at most 2.1% of their scale, median 0.5%: bf16 roundings
    that differ by one ulp, propagated through 4 layers)."""
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(4))
    runs = {}
    for mode in mp.MODES:
        model = _tiny()
        with mp.bf16_gemm(mode):
            with torch.autocast("cpu", torch.bfloat16):
                out = model(ids[:, :-1])
                loss = F.cross_entropy(out.logits.float().flatten(0, 1), ids[:, 1:].flatten()) + out.aux_loss
            loss.backward()
        runs[mode] = (float(loss.detach()), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    (loss_e, grads_e), (loss_n, grads_n) = runs["emulated"], runs["native"]
    assert abs(loss_e - loss_n) <= 1e-3 * abs(loss_n)
    assert grads_e.keys() == grads_n.keys() and len(grads_e) > 20
    for name in grads_n:
        scale = float(grads_n[name].abs().max())
        assert float((grads_e[name] - grads_n[name]).abs().max()) <= 0.05 * scale + 1e-8, name


def test_bf16_rl_parity_study_parses_and_samples_from_bf16_weights():
    """configs/experiments/bf16_parity_rl.yaml: the demo's RL stage in fp32 against bf16-mixed training with rollouts
    from the bf16 copy of the weights, 8 paired seeds, one own question (pass@1 at +-5 points). (A dry run needs the
    demo's pre-training checkpoint, as every RL study.)"""
    path = ROOT / "configs" / "experiments" / "bf16_parity_rl.yaml"
    study = load_study(path)
    assert study.control == "fp32" and len(study.seeds) == 8
    assert [(c.own, c.variant, c.margin) for c in study.claims] == [(True, "bf16", 5.0)]
    arms = {v.name: v.overrides for v in study.variants}
    assert arms == {"fp32": {"trainer.precision": "32-true"},
                    "bf16": {"trainer.precision": "bf16-mixed", "model.init_args.sampling.precision": "bf16"}}


@pytest.mark.parametrize("cpp", [False, True], ids=["pytorch_forms", "cpp_ops"])
def test_backward_inside_autocast(cpp):
    """A backward called inside a bf16 autocast region (as a user's manual optimization may) runs: the ops' own
    backwards turn autocast off (the PyTorch KDA chunkwise backward failed there: a bf16 bmm met fp32 in
    ``baddbmm_``). With the C++ ops every GEMM of the model's backward is in an op's own backward, so the gradients
    equal those of a backward after the region bit for bit; with the PyTorch forms torch's own autograd nodes (e.g.
    the linears' backward GEMMs) still autocast, which is why the stages call backward outside autocast (RL included,
    test_bf16_mixed_fit_keeps_fp32_masters_and_fp32_reductions)."""
    if cpp and not cext.available():
        pytest.skip("C++ ops not available")
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    grads = []
    for inside in (False, True):
        model = _tiny(kda_chunk_size=8)
        with ops.backend.cpp_ops(cpp):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(ids).logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
                if inside:
                    loss.backward()
            if not inside:
                loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    assert all(torch.isfinite(g).all() for g in grads[1].values())
    if cpp:
        for name, g in grads[0].items():
            assert torch.equal(g, grads[1][name]), name
