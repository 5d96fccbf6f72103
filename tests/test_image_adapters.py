"""Image-token adapters: the identity at the start, active only at image positions (text-only inputs run exactly
the loaded model, whatever the adapters learnt), trainable, saved and reloaded with the encoder."""

import pytest
import torch

from glm_lightning.image_adapters import ImageTokenAdapters
from glm_lightning.model.config import GLMConfig
from glm_lightning.model.model import GLMModel
from glm_lightning.modules.vision import VisionModule
from glm_lightning.tokenizer import ByteTokenizer

SMALL = {"dim": 32, "heads": 2, "depth": 1}
SPEC = {"targets": ["model.blocks.*.mixer", "model.blocks.*.moe"], "rank": 4, "alpha": 8}


def _module(**kwargs):
    torch.manual_seed(0)
    return VisionModule(preset="tiny", vision=SMALL, warmup_steps=1, **kwargs).eval()


def _perturb(adapters: ImageTokenAdapters, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapters.named_parameters():
            if name.endswith(".up"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def test_adapters_act_only_at_image_positions():
    torch.manual_seed(0)
    model = GLMModel(GLMConfig.preset("tiny")).eval()
    ids = torch.randint(0, 256, (2, 12))
    ids[:, 5:8] = ByteTokenizer.image_id
    mask = ids == ByteTokenizer.image_id
    with torch.no_grad():
        plain = model(ids).logits
    adapters = ImageTokenAdapters(model, ["blocks.*.mixer", "blocks.*.moe"], width=model.cfg.d_model, rank=4)
    assert len(adapters.targets) == 2 * model.cfg.n_layers
    with torch.no_grad():
        with adapters.active(mask):
            assert torch.equal(model(ids).logits, plain), "up = 0: the identity at the start"
        _perturb(adapters)
        with adapters.active(mask):
            adapted = model(ids).logits
        assert torch.equal(model(ids).logits, plain), "no mask set: exactly the loaded model"
        with adapters.active(torch.zeros_like(mask)):
            assert torch.equal(model(ids).logits, plain), "a text-only input: exactly the loaded model"
    # causal model: positions before the first image token cannot change; the image positions and after do
    assert torch.equal(adapted[:, :5], plain[:, :5])
    assert not torch.allclose(adapted[:, 5:], plain[:, 5:])
    adapters.remove()
    with torch.no_grad(), adapters.active(mask):
        assert torch.equal(model(ids).logits, plain), "hooks removed"


def test_vision_module_text_stays_exact_and_adapters_train():
    m = _module(image_adapters=SPEC, lr_groups=[{"name": "adapters", "params": ["image_adapters.*"], "lr": 1e-2},
                                                {"name": "encoder", "params": ["vision.*"], "lr": 1e-2},
                                                {"name": "frozen", "params": ["model.*"], "lr": 0}])
    text = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        before = m.model(text).logits
    groups = m.param_groups()
    assert {g["name"].split("/")[0] for g in groups} == {"adapters", "encoder"}
    opt = torch.optim.AdamW([p for g in groups for p in g["params"]], lr=1e-2)
    batch = {"image": torch.randn(4, 3, 32, 32), "label": torch.tensor([1, 2, 3, 4])}
    m.train()
    up_before = {n: p.detach().clone() for n, p in m.image_adapters.named_parameters() if n.endswith(".up")}
    for _ in range(3):
        m._step(batch)["loss"].backward()
        opt.step()
        opt.zero_grad()
    m.eval()
    moved = {n for n, p in m.image_adapters.named_parameters() if n.endswith(".up") and
             not torch.equal(p, up_before[n])}
    # the last block's image-position outputs reach no later position (causal, nothing above it): no gradient
    last = m.glm_config.n_layers - 1
    assert moved == {n for n in up_before if f"blocks_{last}_" not in n}, "every adapter the answer can read learnt"
    with torch.no_grad():
        assert torch.equal(m.model(text).logits, before), "text-only forward unchanged after training"


def test_adapters_round_trip_through_a_checkpoint(tmp_path):
    m = _module(image_adapters=SPEC)
    _perturb(m.image_adapters)
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = m(images).logits
    ckpt = {"state_dict": m.state_dict()}
    m.on_save_checkpoint(ckpt)
    assert ckpt["image_adapters"]["rank"] == 4
    assert any(k.startswith("image_adapters.") for k in ckpt["state_dict"])
    path = tmp_path / "vision.ckpt"
    torch.save(ckpt, path)
    again = _module(image_adapters=SPEC, init_weights=str(path))
    with torch.no_grad():
        assert torch.equal(again(images).logits, want)
    with pytest.warns(UserWarning, match="image adapters differ"):
        other = _module(image_adapters={**SPEC, "rank": 2}, init_weights=str(path))
    assert all(not p.any() for n, p in other.image_adapters.named_parameters() if n.endswith(".up"))


def test_bad_image_adapter_settings_name_the_problem():
    with pytest.raises(ValueError, match="unknown key"):
        _module(image_adapters={"targets": ["model.blocks.*.moe"], "rnk": 2})
    with pytest.raises(ValueError, match="matches no submodule"):
        _module(image_adapters={"targets": ["model.blocks.*.nope"]})
    with pytest.raises(ValueError, match="mapping with `targets`"):
        _module(image_adapters={"rank": 2})
    with pytest.raises(ValueError, match="rank"):
        _module(image_adapters={"targets": ["model.blocks.*.moe"], "rank": 0})
