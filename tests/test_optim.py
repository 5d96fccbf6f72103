"""glm_lightning.optim.AdamW (shared step counters) against torch's AdamW: the same parameters, bit for bit against
the fused kernel it calls, within fp32 rounding against the reference for-loop implementation."""

from __future__ import annotations

import io

import pytest
import torch

from glm_lightning.optim import AdamW


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((5, 3), (7,), (2, 4, 3), (1,))]


def _groups(params: list[torch.nn.Parameter]) -> list[dict]:
    return [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]


def _run(opt_cls, steps: int, idle: dict[int, set[int]] | None = None, **kw) -> list[torch.Tensor]:
    """`steps` steps on a fixed quadratic-ish loss; idle[step] = indices of parameters left without a gradient."""
    params = _params()
    opt = opt_cls(_groups(params), lr=3e-2, betas=(0.8, 0.95), **kw)
    _steps(opt, params, 0, steps, idle or {})
    return [p.detach().clone() for p in params]


def _steps(opt, params, start: int, stop: int, idle: dict[int, set[int]]) -> None:
    g = torch.Generator().manual_seed(1)
    targets = [torch.randn(p.shape, generator=g) for p in params]
    for step in range(start, stop):
        opt.zero_grad(set_to_none=True)
        loss = sum(((p - t) ** 2 * (i + 1)).sum() + (p ** 3).mean() * step
                   for i, (p, t) in enumerate(zip(params, targets)) if i not in idle.get(step, ()))
        loss.backward()
        opt.step()


def test_same_parameters_as_torch_fused_adamw_bit_for_bit():
    ours = _run(AdamW, 6)
    ref = _run(torch.optim.AdamW, 6, fused=True)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    for a, b in zip(ours, _run(torch.optim.AdamW, 6, foreach=False)):  # the reference single-tensor loop
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_idle_parameters_keep_their_own_step_count():
    idle = {1: {0}, 2: {0, 3}, 4: {2}}
    ours = _run(AdamW, 6, idle)
    ref = _run(torch.optim.AdamW, 6, idle, fused=True)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    assert not torch.equal(ours[0], _run(AdamW, 6)[0])  # the idle steps did change the result


def test_counters_are_shared_while_stepping_together():
    params = _params()
    opt = AdamW(_groups(params), lr=1e-2)
    _steps(opt, params, 0, 3, {})
    steps = {id(opt.state[p]["step"]) for p in params}
    assert len(steps) == 1 and float(opt.state[params[0]]["step"]) == 3.0
    sd = opt.state_dict()  # a checkpoint holds one counter per parameter, as torch's does
    assert len({id(s["step"]) for s in sd["state"].values()}) == len(params)


@pytest.mark.parametrize("resume_cls", [AdamW, torch.optim.AdamW])
def test_checkpoint_round_trip_continues_like_torch(resume_cls):
    idle = {1: {3}}
    ref = _run(torch.optim.AdamW, 6, idle, fused=True)
    params = _params()
    opt = AdamW(_groups(params), lr=3e-2, betas=(0.8, 0.95))
    _steps(opt, params, 0, 3, idle)
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "params": [p.detach() for p in params]}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    params2 = [torch.nn.Parameter(t.clone()) for t in ckpt["params"]]
    kw = {"fused": True} if resume_cls is torch.optim.AdamW else {}
    opt2 = resume_cls(_groups(params2), lr=3e-2, betas=(0.8, 0.95), **kw)
    opt2.load_state_dict(ckpt["opt"])
    _steps(opt2, params2, 3, 6, idle)
    for a, b in zip(params2, ref):
        assert torch.equal(a.detach(), b)


def test_unsupported_options_fall_back_to_torch():
    ours = _run(AdamW, 4, amsgrad=True)
    ref = _run(torch.optim.AdamW, 4, amsgrad=True, fused=True)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


def test_keeps_the_class_name_lightning_logs():
    assert AdamW.__name__ == "AdamW" and issubclass(AdamW, torch.optim.AdamW)


@pytest.mark.parametrize("kw", [{}, {"amsgrad": True}], ids=["fused", "torch-fallback"])
def test_a_step_bumps_the_version_of_every_updated_parameter(kw):
    """torch's fused kernel writes through data pointers without bumping version counters (torch.optim.AdamW(fused=
    True) leaves them as they were); ours bumps them, so caches keyed on them (generation.sampling_weights) see the
    step. Parameters without a gradient keep theirs."""
    params = _params()
    opt = AdamW(_groups(params), lr=1e-2, **kw)
    sum((p ** 2).sum() for p in params[1:]).backward()
    before = [p._version for p in params]
    opt.step()
    assert params[0]._version == before[0]
    assert all(p._version > v for p, v in zip(params[1:], before[1:]))
