"""Vision tower and vision stage: token order + 2x2 merge, 2D RoPE relative positions, bidirectional per-image
attention, conv == linear patch embed, placeholder splicing, the stage module, weight loading and the CLI."""

from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from glm_lightning.cli import main
from glm_lightning.model import GLMConfig
from glm_lightning.model.rope2d import Rope2D, grid_positions, window_order
from glm_lightning.model.vision import VisionConfig, VisionEncoder, patchify, splice_image_features
from glm_lightning.modules.vision import VisionModule, image_prompt_ids
from glm_lightning.tokenizer import ByteTokenizer

CONF = str(Path(__file__).parent / "conf" / "vision_tiny.yaml")
TOK = ByteTokenizer()
SMALL = {"dim": 32, "heads": 2, "depth": 1}


# --- encoder ----------------------------------------------------------------------------------------------------------
def test_encoder_shapes_and_token_counts():
    torch.manual_seed(0)
    vit = VisionEncoder(VisionConfig(), out_dim=48)
    assert vit.cfg.num_tokens == 16 and vit.positions.shape == (64, 2)
    assert vit(torch.randn(2, 3, 32, 32)).shape == (2, 16, 48)
    assert vit.encode_patches(torch.randn(2, 3, 32, 32)).shape == (2, 64, 128)
    direct = VisionEncoder(VisionConfig(encoder="direct", patch_size=8), out_dim=48)
    assert direct.cfg.num_tokens == 16 and direct(torch.randn(3, 3, 32, 32)).shape == (3, 16, 48)
    assert sum(p.numel() for p in direct.parameters()) == 3 * 64 * 48 + 48
    # other sizes: 64x64 with patch 8 -> 8x8 patches -> 16 tokens
    big = VisionEncoder(VisionConfig(image_size=64, patch_size=8, **SMALL), out_dim=16)
    assert big(torch.randn(1, 3, 64, 64)).shape == (1, 16, 16)


def test_window_order_groups_each_2x2_block():
    perm = window_order(4, 4, 2)
    assert perm.tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
    assert sorted(perm.tolist()) == list(range(16))
    pos = grid_positions(4, 4, 2)
    assert (pos[:, 0] * 4 + pos[:, 1]).tolist() == perm.tolist()  # RoPE ids follow the same permutation


def test_merged_token_k_holds_exactly_the_kth_2x2_block():
    cfg = VisionConfig(**SMALL)
    enc = VisionEncoder(cfg, out_dim=8)
    g, p = cfg.grid, cfg.patch_size
    # an image whose patch (r, c) carries the unique id r * g + c in its top-left pixel; the conv copies it out
    img = torch.zeros(1, 3, 32, 32)
    for r in range(g):
        for c in range(g):
            img[0, 0, r * p, c * p] = r * g + c
    with torch.no_grad():
        enc.patch_embed.weight.zero_()
        enc.patch_embed.bias.zero_()
        enc.patch_embed.weight[0, 0, 0, 0] = 1.0
    tokens = enc.patch_tokens(img)
    ids = tokens[0, :, 0].round().long()
    assert sorted(ids.tolist()) == list(range(g * g))
    assert (enc.positions[:, 0] * g + enc.positions[:, 1]).tolist() == ids.tolist()  # positions match the tokens
    windows = enc.merger.group_windows(tokens).view(1, -1, 4, cfg.dim)[0, :, :, 0].round().long()
    assert windows.shape[0] == cfg.num_tokens == 16
    half = g // 2
    for k in range(windows.shape[0]):
        br, bc = divmod(k, half)
        block = {(2 * br + dr) * g + 2 * bc + dc for dr in (0, 1) for dc in (0, 1)}
        assert set(windows[k].tolist()) == block, (k, windows[k].tolist(), block)


def test_conv_patch_embed_equals_linear_form():
    torch.manual_seed(0)
    enc = VisionEncoder(VisionConfig(**SMALL), out_dim=8)
    x = torch.randn(2, 3, 32, 32)
    conv = enc.patch_embed(x).flatten(2).transpose(1, 2)  # row-major
    w = enc.patch_embed.weight.flatten(1)
    linear = patchify(x, 4) @ w.T + enc.patch_embed.bias
    torch.testing.assert_close(conv, linear, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(enc.patch_tokens(x), linear[:, enc.perm])


def test_rope2d_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    D = 16
    rope = Rope2D(D)
    q, k = torch.randn(D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)

    def score(a, b):
        pos = torch.tensor([a, b])
        rq, rk = rope(q.float().expand(2, D), pos).double()[0], rope(k.float().expand(2, D), pos).double()[1]
        return float(rq @ rk)

    base = score((1, 2), (4, 7))
    for s, t in [(0, 0), (3, 0), (0, 5), (2, -1), (6, 9)]:
        assert score((1 + s, 2 + t), (4 + s, 7 + t)) == pytest.approx(base, abs=1e-4)
    assert abs(score((1, 2), (5, 7)) - base) > 1e-3  # a different drow changes the score
    assert abs(score((1, 2), (4, 8)) - base) > 1e-3  # a different dcol changes the score
    # half of the pairs carry the row, half the column
    x = torch.randn(1, D)
    a, b = rope(x, torch.tensor([[3, 1]]))[0], rope(x, torch.tensor([[3, 6]]))[0]
    row_ch = torch.cat((torch.arange(0, D // 4), torch.arange(D // 2, 3 * D // 4)))
    col_ch = torch.cat((torch.arange(D // 4, D // 2), torch.arange(3 * D // 4, D)))
    torch.testing.assert_close(a[row_ch], b[row_ch])
    assert not torch.allclose(a[col_ch], b[col_ch])
    # rotations preserve norms
    torch.testing.assert_close(a.norm(), x.norm())


def test_attention_is_bidirectional_within_an_image_and_never_crosses_images():
    torch.manual_seed(0)
    enc = VisionEncoder(VisionConfig(**SMALL), out_dim=16).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = enc(x)
        y = x.clone()
        y[0, :, -4:, -4:] += 1.0  # bottom-right patch of image 0 (the last token in window order)
        out = enc(y)
        assert not torch.allclose(out[0, 0], ref[0, 0], atol=1e-5)  # the first token sees the last patch
        torch.testing.assert_close(out[1], ref[1], rtol=0, atol=1e-6)  # image 1 untouched
        z = x.clone()
        z[1] = torch.randn(3, 32, 32)  # perturb image 2 entirely
        torch.testing.assert_close(enc(z)[0], ref[0], rtol=0, atol=1e-6)


def test_bad_images_and_configs_raise():
    enc = VisionEncoder(VisionConfig(**SMALL), out_dim=8)
    for bad in (torch.randn(3, 32, 32), torch.randn(1, 1, 32, 32), torch.randn(1, 3, 28, 28),
                torch.zeros(1, 3, 32, 32, dtype=torch.uint8)):
        with pytest.raises(ValueError, match="images must"):
            enc(bad)
    for kwargs in ({"image_size": 30}, {"encoder": "cnn"}, {"dim": 24, "heads": 4}, {"patch_size": 8, "merge": 8},
                   {"depth": 0}):
        with pytest.raises(ValueError, match="VisionConfig"):
            VisionConfig(**kwargs)
    with pytest.raises(ValueError, match="unknown VisionConfig"):
        VisionConfig.from_dict({"widht": 3})


# --- splicing ---------------------------------------------------------------------------------------------------------
def test_splice_replaces_exactly_the_placeholders_and_checks_the_count():
    ids = torch.tensor([image_prompt_ids(4), image_prompt_ids(4)])
    embeds = torch.randn(2, ids.shape[1], 8)
    feats = torch.randn(2, 4, 8)
    out = splice_image_features(embeds, ids, feats, TOK.image_id)
    mask = ids == TOK.image_id
    torch.testing.assert_close(out[mask], feats.reshape(-1, 8))
    torch.testing.assert_close(out[~mask], embeds[~mask])
    with pytest.raises(ValueError, match="placeholder"):
        splice_image_features(embeds, ids, torch.randn(2, 3, 8), TOK.image_id)
    bad = ids.clone()
    bad[0, 2], bad[1, 0] = TOK.bos_id, TOK.image_id  # 3 + 5 placeholders: the total fits, the rows do not
    with pytest.raises(ValueError, match="placeholders"):
        splice_image_features(embeds, bad, feats, TOK.image_id)
    # flat features fill the placeholders in order, whatever the rows hold
    flat = torch.randn(8, 8)
    torch.testing.assert_close(splice_image_features(embeds, bad, flat, TOK.image_id)[bad == TOK.image_id], flat)
    with pytest.raises(ValueError, match="width"):
        splice_image_features(embeds, ids, torch.randn(2, 4, 5), TOK.image_id)


# --- the stage module -------------------------------------------------------------------------------------------------
def _module(**kwargs):
    torch.manual_seed(0)
    return VisionModule(preset="tiny", vision=SMALL, warmup_steps=1, **kwargs)


def test_module_prompt_loss_and_predictions():
    m = _module(eos_loss=True)
    assert m.prompt_ids.tolist() == image_prompt_ids(16, "Digit: ")
    assert m.prompt_ids.tolist()[:2] == [TOK.bos_id, TOK.image_start_id]
    assert TOK.decode(m.prompt_ids) == "Digit: " and int((m.prompt_ids == TOK.image_id).sum()) == 16
    batch = {"image": torch.randn(3, 3, 32, 32), "label": torch.tensor([0, 7, 9])}
    r = m._step(batch)
    assert r["preds"].shape == (3,) and 0 <= int(r["preds"].min()) and int(r["preds"].max()) <= 9
    assert torch.isfinite(r["loss"]) and r["loss"] > 0
    m.eval()
    logits = m(batch["image"]).logits
    assert logits.shape == (3, m.prompt_ids.numel(), TOK.vocab_size)
    with pytest.raises(ValueError, match="0..9"):
        m._step({"image": torch.randn(2, 3, 32, 32), "label": torch.tensor([3, 10])})
    with pytest.raises(ValueError, match="channels"):
        m._step({"image": torch.randn(2, 1, 32, 32), "label": torch.tensor([3, 1])})


def test_init_weights_from_pretrain_checkpoint_and_config_mismatch(tmp_path):
    src = _module()
    ckpt = tmp_path / "pretrain.ckpt"
    torch.save({"glm_config": src.glm_config.to_dict(),
                "state_dict": {f"model.{k}": v for k, v in src.model.state_dict().items()}}, ckpt)
    torch.manual_seed(1)
    dst = VisionModule(preset="tiny", vision=SMALL, init_weights=str(ckpt))
    for k, v in src.model.state_dict().items():
        assert torch.equal(dst.model.state_dict()[k], v), k
    with pytest.raises(ValueError, match="different model config"):
        VisionModule(preset="tiny", model_overrides={"expert_hidden": 48}, vision=SMALL, init_weights=str(ckpt))
    with pytest.raises(FileNotFoundError):
        VisionModule(preset="tiny", vision=SMALL, init_weights=str(tmp_path / "missing.ckpt"))
    # a vision checkpoint also restores the encoder (same vision config)
    vckpt = tmp_path / "vision.ckpt"
    payload = {"state_dict": src.state_dict()}
    src.on_save_checkpoint(payload)
    torch.save(payload, vckpt)
    again = VisionModule(preset="tiny", vision=SMALL, init_weights=str(vckpt))
    for k, v in src.vision.state_dict().items():
        assert torch.equal(again.vision.state_dict()[k], v), k
    assert GLMConfig(**payload["glm_config"]) == src.glm_config


# --- through the CLI --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("encoder", ["vit", "direct"])
def test_fast_dev_run(tmp_path, encoder):
    args = ["fit", "--config", CONF, "--trainer.fast_dev_run", "2", "--trainer.default_root_dir", str(tmp_path)]
    if encoder == "direct":
        args += ["--model.init_args.vision", '{"encoder": "direct", "patch_size": 8}']
    main(args)


def test_short_run_logs_figures_and_tests_from_checkpoint(tmp_path):
    common = ["--config", CONF, "--trainer.logger.init_args.save_dir", str(tmp_path / "logs")]
    main(["fit", *common, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
          "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.save_last=true",
          "--trainer.callbacks.dirpath", str(tmp_path / "ckpt")])
    run = tmp_path / "logs" / "vision_test" / "version_0"
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    tags = acc.Tags()
    for tag in ("train/loss", "train/acc", "val/acc", "val/loss"):
        assert tag in tags["scalars"], sorted(tags["scalars"])
    assert {"val/confusion_matrix", "val/predictions"} <= set(tags["images"]), tags["images"]
    last = tmp_path / "ckpt" / "last.ckpt"
    ckpt = torch.load(last, weights_only=False)
    assert ckpt["global_step"] == 2 and ckpt["vision_config"]["dim"] == 32 and "glm_config" in ckpt

    main(["test", *common, "--ckpt_path", str(last)])
    acc = EventAccumulator(str(tmp_path / "logs" / "vision_test" / "version_1"),
                           size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    assert "test/acc" in acc.Tags()["scalars"] and "test/confusion_matrix" in acc.Tags()["images"]
    value = acc.Scalars("test/acc")[-1].value
    assert 0.0 <= value <= 1.0
