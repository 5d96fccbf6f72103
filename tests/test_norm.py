import torch
import torch.nn.functional as F

from glm_lightning.model.norm import RMSNorm
from glm_lightning.model.ops import reference, rms_norm


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
    out, ref = norm(a), reference.rms_norm(b, w_ref, 1e-5)
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
    torch.testing.assert_close(out, reference.rms_norm(x.detach(), w, 1e-6), atol=1e-6, rtol=1e-5)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_cpp_and_eager_norms_equal_the_formula_over_many_rows(monkeypatch):
    """The C++ rms_norm (csrc/rms_norm.cpp) and the op without it (the reference form), both against the reference form, on 300 rows (five
    of the op's 64-row blocks, the last partial); the C++ weight gradient is the same bit for bit at 1 and 2 threads
    (fixed blocks, summed in order)."""
    import pytest

    from glm_lightning.model import cext

    if not cext.available():
        pytest.skip("C++ ops disabled (GLM_LIGHTNING_EXT=0) or not buildable")
    gen = torch.Generator().manual_seed(5)
    x, w, g = torch.randn(3, 100, 48, generator=gen), torch.randn(48, generator=gen), torch.randn(3, 100, 48, generator=gen)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = reference.rms_norm(xr, wr, 1e-5)
    ref_grads = torch.autograd.grad(ref, (xr, wr), g)
    results = []
    for use_cpp, threads in ((False, 1), (True, 1), (True, 2)):
        monkeypatch.setattr(cext, "available", lambda use_cpp=use_cpp: use_cpp)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = rms_norm(xa, wa, 1e-5)
            grads = torch.autograd.grad(out, (xa, wa), g)
        finally:
            torch.set_num_threads(before)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        results.append((out, *grads))
    assert all(torch.equal(a, b) for a, b in zip(results[1], results[2]))
