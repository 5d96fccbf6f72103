import torch
import torch.nn.functional as F

from glm_lightning.model.norm import RMSNorm, rms_norm


def _plain(x, w, eps):
    """The formula, differentiated by autograd (the naive reference)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def test_fused_rms_norm_gradcheck_float64():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-5), (x, w))
    assert torch.autograd.gradcheck(lambda a: rms_norm(a, None, 1e-5), (x,))


def test_fused_rms_norm_equals_formula_fp32_forward_and_backward():
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(4, 7, 16)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    w_ref = norm.weight.detach().clone().requires_grad_()
    out, ref = norm(a), _plain(b, w_ref, 1e-5)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out, F.rms_norm(x, (16,), norm.weight, 1e-5), atol=1e-6, rtol=1e-5)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(norm.weight.grad, w_ref.grad, atol=1e-5, rtol=1e-5)


def test_rms_norm_non_contiguous_input_and_frozen_weight():
    torch.manual_seed(0)
    x = torch.randn(5, 8, 3).transpose(1, 2).requires_grad_()  # [5, 3, 8] strided
    w = torch.randn(8)
    out = rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out, _plain(x.detach(), w, 1e-6), atol=1e-6, rtol=1e-5)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
