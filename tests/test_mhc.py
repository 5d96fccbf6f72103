import pytest
import torch
from torch import nn

from glm_lightning.model import ops
from glm_lightning.model.mhc import HyperConnection, collapse_streams, expand_streams
from glm_lightning.model.norm import RMSNorm
from glm_lightning.model.ops import mhc as mhc_ops
from glm_lightning.model.ops.reference import sinkhorn_knopp as sinkhorn_reference
from glm_lightning.model.ops.reference import stream_read as read_streams


def sinkhorn_knopp(logits, iters=20, eps=1e-6, fused=None):
    """The Sinkhorn op as the ops layer picks it (fused None), or forced to its C++ (True) or PyTorch (False) form."""
    if fused is None:
        return mhc_ops.sinkhorn(logits, iters, eps)
    flat = logits.reshape(-1, *logits.shape[-2:])
    return (mhc_ops._SinkhornCpp if fused else mhc_ops._Sinkhorn).apply(flat, iters, eps).view(logits.shape)


def test_sinkhorn_doubly_stochastic():
    torch.manual_seed(0)
    # finite Sinkhorn: the last-normalised axis (columns) is exact, rows converge slower for peaked logits
    for std, row_tol in ((0.5, 1e-3), (1.0, 1e-3), (2.0, 1e-2)):
        m = sinkhorn_knopp(torch.randn(64, 4, 4) * std, iters=20, eps=1e-6)
        assert (m >= 0).all()
        assert torch.allclose(m.sum(-2), torch.ones(64, 4), atol=1e-5)
        assert torch.allclose(m.sum(-1), torch.ones(64, 4), atol=row_tol)


def test_sinkhorn_product_of_many_sites_stays_bounded():
    torch.manual_seed(1)
    prod = torch.eye(4)
    for _ in range(24):
        prod = sinkhorn_knopp(torch.randn(4, 4)) @ prod
    assert prod.sum(0).max() < 1.1 and prod.sum(1).max() < 1.1


def test_n1_equals_plain_pre_norm_residual():
    torch.manual_seed(0)
    norm, f = RMSNorm(8), nn.Linear(8, 8)
    site = HyperConnection(n=1, dim=8)
    x = torch.randn(2, 5, 8)
    out = site(expand_streams(x, 1), lambda h: f(norm(h)))
    assert torch.equal(collapse_streams(out), x + f(norm(x)))
    assert sum(p.numel() for p in site.parameters()) == 0


def test_identity_mappings_reduce_to_residual():
    """With pre = 1/n, post = 1, res = I and identical streams, the site is x + F(x) on every stream."""
    torch.manual_seed(0)
    n, c = 4, 8
    site = HyperConnection(n=n, dim=c)
    f = nn.Linear(c, c)
    x = torch.randn(2, 3, c)
    streams = expand_streams(x, n)
    pre, post, res = (torch.full(streams.shape[:-1], 1.0 / n), torch.ones(streams.shape[:-1]),
                      torch.eye(n).expand(*streams.shape[:-2], n, n))
    out = site.write(streams, (post, res), f(ops.stream_read(pre, streams)))
    assert torch.allclose(out, (x + f(x)).unsqueeze(-2).expand(2, 3, n, c), atol=1e-6)


def test_shape_persists_and_streams_diverge():
    torch.manual_seed(0)
    n, c = 4, 16
    sites = [HyperConnection(n=n, dim=c, site_index=i) for i in range(4)]
    f = nn.Sequential(RMSNorm(c), nn.Linear(c, c))
    s = expand_streams(torch.randn(2, 6, c), n)
    assert torch.equal(s[:, :, 0], s[:, :, 1])
    for site in sites:
        s = site(s, f)
        assert s.shape == (2, 6, n, c)
    assert (s[:, :, 0] - s[:, :, 1]).abs().max() > 1e-3  # symmetry broken


def test_mappings_ranges_and_gradients():
    torch.manual_seed(0)
    site = HyperConnection(n=4, dim=8)
    x = torch.randn(3, 5, 4, 8)
    pre, post, res = site.mappings(x)
    assert (pre > 0).all() and (pre <= 1 + 1e-5).all()
    assert (post > 0).all() and (post < 2).all()
    assert torch.allclose(res.sum(-2), torch.ones(3, 5, 4), atol=1e-5)
    out = site(x, torch.tanh)
    out.square().sum().backward()
    for name, p in site.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_site_is_causal():
    torch.manual_seed(0)
    site = HyperConnection(n=4, dim=8)
    x = torch.randn(1, 10, 4, 8)
    y = x.clone()
    y[:, 6:] += torch.randn_like(y[:, 6:])
    assert torch.equal(site(x, torch.tanh)[:, :6], site(y, torch.tanh)[:, :6])


# fused=False: the PyTorch twin with its hand-written backward; None: the op as the ops layer picks it
BOTH_PATHS = pytest.mark.parametrize("fused", [False, None], ids=["eager", "default"])


@BOTH_PATHS
def test_sinkhorn_entries_major_layout_equals_reference(fused):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 4, 4) * 3
    out = sinkhorn_knopp(logits, fused=fused)
    assert out.is_contiguous() and out.shape == logits.shape
    torch.testing.assert_close(out.double(), sinkhorn_reference(logits.double()), atol=1e-6, rtol=1e-5)


def test_stream_read_equals_its_formula():
    torch.manual_seed(0)
    post, x = torch.rand(2, 3, 4), torch.randn(2, 3, 4, 5)
    torch.testing.assert_close(read_streams(post, x), torch.einsum("btn,btnc->btc", post, x))


@BOTH_PATHS
def test_sinkhorn_hand_written_backward_gradcheck(fused):
    torch.manual_seed(0)
    logits = (torch.randn(2, 3, 4, 4, dtype=torch.float64) * 2).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: sinkhorn_knopp(x, iters=5, fused=fused), (logits,))


@BOTH_PATHS
def test_sinkhorn_backward_equals_autograd_of_the_iterations_fp32(fused):
    torch.manual_seed(0)
    logits = torch.randn(6, 7, 4, 4) * 2 + 4 * torch.eye(4)
    weight = torch.randn(6, 7, 4, 4)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    out_a, out_b = sinkhorn_knopp(a, fused=fused), sinkhorn_reference(b)
    torch.testing.assert_close(out_a, out_b, atol=1e-6, rtol=1e-5)
    (out_a * weight).sum().backward()
    (out_b * weight).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


def test_site_params_follow_a_parametrized_phi_and_moved_buffers():
    """The site reads its parameters from the module's dicts (fast): a LoRA-parametrized phi (a property, not in the
    dict) and buffers replaced by a dtype move are still what it reads."""
    from glm_lightning.lora import apply_lora

    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.site = HyperConnection(n=2, dim=4)
    apply_lora(holder, ["site.phi"], rank=2)
    with torch.no_grad():
        holder.site.parametrizations.phi[0].lora_B.normal_()  # a non-zero adapter
    assert torch.equal(holder.site._params()[0], holder.site.phi)
    assert not torch.equal(holder.site._params()[0], holder.site.parametrizations.phi.original)
    holder.double()
    params = holder.site._params()
    assert params[3] is holder.site._alpha_index and params[4].dtype == torch.float64
