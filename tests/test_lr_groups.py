"""Per-group learning rates: the YAML form is checked, first match wins, lr 0 freezes, the rest keeps the stage lr,
and in the vision stage a frozen language model stays bit-identical while the encoder learns."""

import pytest
import torch
from torch import nn

from glm_lightning.modules.lr_groups import assign_groups, build_param_groups, parse_lr_groups
from glm_lightning.modules.vision import VisionModule

SMALL = {"dim": 32, "heads": 2, "depth": 1}


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.block = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


def test_parse_rejects_bad_specs_with_the_entry_named():
    for specs, match in (({"name": "a"}, "list"), ([{"name": "a", "params": ["x"], "lr": -1}], "lr"),
                         ([{"name": "a", "params": "x"}], "params"), ([{"params": ["x"]}], "name"),
                         ([{"name": "a", "params": ["x"]}, {"name": "a", "params": ["y"]}], "used once"),
                         ([{"name": "a", "params": ["x"], "lrr": 1}], "unknown key")):
        with pytest.raises(ValueError, match=match):
            parse_lr_groups(specs)
    assert parse_lr_groups(None) == []


def test_first_match_wins_and_unmatched_go_to_rest():
    groups = parse_lr_groups([{"name": "norms", "params": ["*norm*"], "lr": 0.1},
                              {"name": "all", "params": ["*.weight"], "lr": 0.2}])
    which = assign_groups(["a.norm.weight", "a.lin.weight", "a.lin.bias"], groups)
    assert which == {"a.norm.weight": "norms", "a.lin.weight": "all", "a.lin.bias": "rest"}
    with pytest.raises(ValueError, match="'nope.*' matches no parameter"):
        assign_groups(["a.b"], parse_lr_groups([{"name": "x", "params": ["nope.*"]}]))


def test_build_groups_lrs_decay_split_and_freezing():
    toy = Toy()
    groups = parse_lr_groups([{"name": "enc", "params": ["enc.*"], "lr": 1e-2},
                              {"name": "block", "params": ["block.*"], "lr": 0},
                              {"name": "norm", "params": ["norm.*"]}])
    out = build_param_groups(toy.named_parameters(), groups, base_lr=1e-3, weight_decay=0.1)
    by_name = {g["name"]: g for g in out}
    assert set(by_name) == {"enc", "enc/no_decay", "norm/no_decay"}
    assert by_name["enc"]["lr"] == 1e-2 and by_name["enc"]["weight_decay"] == 0.1
    assert by_name["enc/no_decay"]["params"] == [toy.enc.bias] and by_name["enc/no_decay"]["weight_decay"] == 0.0
    assert by_name["norm/no_decay"]["lr"] == 1e-3  # no lr given: the stage's
    assert not toy.block.weight.requires_grad and not toy.block.bias.requires_grad
    # parameters frozen before (a FreezeCallback) stay out even when their group has an lr
    toy2 = Toy()
    toy2.norm.requires_grad_(False)
    out = build_param_groups(toy2.named_parameters(), groups, base_lr=1e-3, weight_decay=0.1)
    assert "norm/no_decay" not in {g["name"] for g in out}
    with pytest.raises(ValueError, match="no trainable"):
        build_param_groups(Toy().named_parameters(), parse_lr_groups([{"name": "x", "params": ["*"], "lr": 0}]),
                           1e-3, 0.1)


def test_vision_stage_with_a_frozen_lm_moves_only_the_encoder():
    torch.manual_seed(0)
    m = VisionModule(preset="tiny", vision=SMALL, warmup_steps=0, lr_groups=[
        {"name": "encoder", "params": ["vision.*"], "lr": 1e-2},
        {"name": "norms", "params": ["model.*norm*"], "lr": 0},
        {"name": "lm", "params": ["model.*"], "lr": 0}])
    opt = torch.optim.AdamW(m.param_groups(), lr=m.hparams.lr)
    assert {g["name"] for g in opt.param_groups} == {"encoder", "encoder/no_decay"}
    assert all(g["lr"] == 1e-2 for g in opt.param_groups)
    lm_before = {k: v.clone() for k, v in m.model.state_dict().items()}
    enc_before = {k: v.clone() for k, v in m.vision.state_dict().items()}
    loss = m.training_step({"image": torch.randn(4, 3, 32, 32), "label": torch.tensor([1, 2, 3, 4])}, 0)
    loss.backward()
    opt.step()
    assert all(torch.equal(v, lm_before[k]) for k, v in m.model.state_dict().items())
    assert any(not torch.equal(v, enc_before[k]) for k, v in m.vision.state_dict().items())
