"""Vision fine-tuning that keeps the language model: adapters in the vision stage (identity at start, merged
checkpoints that load anywhere, exact resume state), text replay losses, and the text dev pass + per-family
regression callbacks running in the vision stage next to digit accuracy."""

from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from glm_lightning.cli import main
from glm_lightning.lora import is_lora_parametrized
from glm_lightning.modules.vision import VisionModule

CONF = Path(__file__).parent / "conf"
SMALL = {"dim": 32, "heads": 2, "depth": 1}
LORA = {"targets": ["model.blocks.*.mixer.*_proj.weight"], "rank": 2, "alpha": 4}


def _module(**kwargs):
    torch.manual_seed(0)
    return VisionModule(preset="tiny", vision=SMALL, warmup_steps=1, **kwargs).eval()


def _perturb_adapters(m):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def test_adapters_start_as_the_identity_and_freeze_their_base():
    plain, adapted = _module(), _module(lora=LORA)
    from fnmatch import fnmatchcase
    want = [n for n, q in plain.named_parameters() if q.dim() == 2 and fnmatchcase(n, LORA["targets"][0])]
    assert adapted.lora_targets == want and len(want) > 10
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(plain(images).logits, adapted(images).logits)
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad and n.startswith("model.blocks")}
    assert trainable and not any(n.endswith(".original") for n in trainable)
    with pytest.raises(ValueError, match="unknown key"):
        _module(lora={"targets": ["model.*"], "rnk": 2})
    with pytest.raises(ValueError, match="matches no parameter"):
        _module(lora={"targets": ["model.blocks.*.nope"]})


def test_checkpoint_holds_merged_weights_and_the_adapters_for_resuming(tmp_path):
    m = _module(lora=LORA)
    _perturb_adapters(m)
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = m(images).logits
    ckpt = {"state_dict": m.state_dict()}
    m.on_save_checkpoint(ckpt)
    assert not any("parametrizations" in k or "lora_" in k for k in ckpt["state_dict"]), "plain keys only"
    assert any(k.endswith("lora_A") for k in ckpt["lora_state"])
    # a later stage without adapters loads the merged weights and computes the same function
    path = tmp_path / "vision.ckpt"
    torch.save(ckpt, path)
    later = VisionModule(preset="tiny", vision=SMALL, init_weights=str(path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(later(images).logits, want, rtol=1e-5, atol=1e-5)
    # resuming the adapted run restores base + adapters exactly
    resumed = _module(lora=LORA)
    loaded = torch.load(path, weights_only=False)
    resumed.on_load_checkpoint(loaded)
    resumed.load_state_dict(loaded["state_dict"])
    with torch.no_grad():
        assert torch.equal(resumed(images).logits, want)
    # merging in place: same outputs, no parametrizations left
    from glm_lightning.lora import merge_lora
    assert merge_lora(m) == len(m.lora_targets) and not is_lora_parametrized(m)
    with torch.no_grad():
        torch.testing.assert_close(m(images).logits, want, rtol=1e-5, atol=1e-5)


def test_text_batches_add_a_next_token_loss():
    m = _module(model_overrides={"max_seq_len": 192}, text_loss_weight=0.5)  # eval mode: deterministic
    digits = {"image": torch.randn(2, 3, 32, 32), "label": torch.tensor([1, 2])}
    ids = torch.randint(0, 256, (2, 16))
    targets = ids.roll(-1, 1)
    targets[:, -1] = -100
    image_only = m.training_step(digits, 0)
    both = m.training_step({**digits, "text": {"input_ids": ids, "targets": targets}}, 0)
    with torch.no_grad():
        out = m.model(ids)
        text = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        aux = out.aux_loss
    torch.testing.assert_close(both - image_only, 0.5 * text + m.hparams.aux_loss_weight * aux, rtol=1e-4,
                               atol=1e-5)


def test_vision_run_with_replay_adapters_and_text_eval_logs_everything(tmp_path):
    logs = tmp_path / "logs"
    main(["fit", "--config", str(CONF / "vision_tiny.yaml"), "--config", str(CONF / "vision_text_eval.yaml"),
          "--trainer.logger.init_args.save_dir", str(logs), "--trainer.default_root_dir", str(tmp_path)])
    run = logs / "vision_test" / "version_0"
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    for tag in ("train/image_loss", "train/text_loss", "val/acc", "text/greedy_pass", "regression/double/delta",
                "regression/baseline/double", "lr-AdamW/adapters", "lr-AdamW/encoder"):
        assert tag in scalars, (tag, sorted(scalars))
    assert {"val/confusion_matrix", "val/predictions"} <= set(acc.Tags()["images"])
    assert (run / "regression_report.json").is_file()
    last = next(run.rglob("last.ckpt"))
    ckpt = torch.load(last, weights_only=False)
    assert "lora_state" in ckpt and not any("parametrizations" in k for k in ckpt["state_dict"])
    # the frozen LM (lr 0) kept its weights; only adapters changed, and the merged checkpoint carries them
    later = VisionModule(preset="tiny", model_overrides={"max_seq_len": 192}, vision=SMALL, init_weights=str(last))
    assert not is_lora_parametrized(later)


def test_forgetting_study_validates_every_variant(tmp_path, monkeypatch, capsys):
    """The study's dry run parses the base plus each method's overrides and instantiates model, data and callbacks
    (with a stand-in for the demo's pre-training checkpoint that the real study starts from)."""
    from glm_lightning.model import GLMConfig, GLMModel
    from glm_lightning.sweep.cli import run_sweep
    from glm_lightning.sweep.study import load_study

    monkeypatch.chdir(tmp_path)
    cfg = GLMConfig.preset("demo")
    ckpt = tmp_path / "lightning_logs" / "demo" / "pretrain.ckpt"
    ckpt.parent.mkdir(parents=True)
    torch.save({"glm_config": cfg.to_dict(),
                "state_dict": {f"model.{k}": v for k, v in GLMModel(cfg).state_dict().items()}}, ckpt)
    study_path = Path(__file__).resolve().parent.parent / "configs" / "experiments" / "vision_forgetting.yaml"
    study = load_study(study_path)
    assert [v.name for v in study.variants] == ["frozen_lm", "last_block", "replay", "replay_every_batch",
                                                "group_lrs", "adapters", "adapters_replay", "image_adapters"]
    assert study.seeds == [0, 1, 2] and study.primary.tag == "val/acc"
    run_sweep(["--config", str(study_path), "--out", str(tmp_path / "sweeps"), "--dry-run"])
    out = capsys.readouterr().out
    assert out.count("python -m glm_lightning fit") == 8 * 3


def test_adapted_kda_weights_evaluate_under_inference_mode_and_never_go_stale():
    """KDA caches its fused q/k/v weights by tensor identity when autograd is off; adapted weights must work in
    inference mode and a change of the adapters must change the outputs (to those of the merged model)."""
    m = _module(lora={"targets": ["model.blocks.0.mixer.[qkv]_proj.weight"], "rank": 2, "alpha": 4})
    images = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        first = m(images).logits.clone()
    _perturb_adapters(m)  # in place: the adapters' version counters move
    with torch.inference_mode():
        second = m(images).logits.clone()
        again = m(images).logits.clone()
    assert not torch.equal(first, second) and torch.equal(second, again)
    from glm_lightning.lora import merge_lora
    merge_lora(m)
    with torch.inference_mode():
        torch.testing.assert_close(m(images).logits, second, rtol=1e-5, atol=1e-5)
