"""The C++ mHC ops (glm_lightning/model/csrc/sinkhorn.cpp, streams.cpp, site_read.cpp) against their PyTorch forms:
forward and gradients within 1e-5 in fp32, gradcheck in fp64, and a whole training step of the model with and without
them."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from glm_lightning.model import GLMConfig, GLMModel, cext
from glm_lightning.model.ops import mhc as mhc_ops, reference
from glm_lightning.model.ops.reference import stream_read as read_streams


def sinkhorn_knopp(logits, iters=20, eps=1e-6, fused=None):
    """The Sinkhorn op as the ops layer picks it (fused None), or forced to its C++ (True) or PyTorch (False) form."""
    if fused is None:
        return mhc_ops.sinkhorn(logits, iters, eps)
    flat = logits.reshape(-1, *logits.shape[-2:])
    return (mhc_ops._SinkhornCpp if fused else mhc_ops._Sinkhorn).apply(flat, iters, eps).view(logits.shape)

pytestmark = pytest.mark.skipif(not cext.available(), reason="C++ ops disabled (GLM_LIGHTNING_EXT=0) or not buildable")


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("iters", [1, 5, 20])
def test_cpp_equals_eager_forward_and_backward_fp32(n, iters):
    torch.manual_seed(n * 100 + iters)
    # 37 tokens: two full blocks of 16 and a partial one; std 2 gives peaked, slowly converging matrices
    logits = (torch.randn(37, n, n) * 2.0).requires_grad_()
    grad = torch.randn(37, n, n)
    eager = sinkhorn_knopp(logits, iters=iters, fused=False)
    fused = sinkhorn_knopp(logits, iters=iters, fused=True)
    torch.testing.assert_close(fused, eager, atol=1e-5, rtol=1e-5)
    (g_eager,) = torch.autograd.grad(eager, logits, grad)
    (g_fused,) = torch.autograd.grad(fused, logits, grad)
    torch.testing.assert_close(g_fused, g_eager, atol=1e-5, rtol=1e-5)
    assert g_fused.abs().max() > 1e-3  # a real gradient, not two zeros


def test_cpp_reads_strided_tokens_and_leading_dims():
    """The mHC site passes a slice of its fused logits [B, T, (2+n)n]: token stride != n*n."""
    torch.manual_seed(1)
    n = 4
    big = torch.randn(2, 9, (2 + n) * n, requires_grad=True)
    res_logits = big[..., 2 * n:].unflatten(-1, (n, n))
    assert not res_logits.is_contiguous()
    eager = sinkhorn_knopp(res_logits, fused=False)
    fused = sinkhorn_knopp(res_logits, fused=True)
    assert fused.shape == (2, 9, n, n)
    torch.testing.assert_close(fused, eager, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(eager)
    (g_eager,) = torch.autograd.grad(eager, big, grad)
    (g_fused,) = torch.autograd.grad(fused, big, grad)
    torch.testing.assert_close(g_fused, g_eager, atol=1e-5, rtol=1e-5)
    assert (g_fused[..., :2 * n] == 0).all()  # the gate logits get nothing from Sinkhorn


def test_cpp_gradcheck_fp64():
    torch.manual_seed(2)
    logits = torch.randn(19, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: sinkhorn_knopp(x, iters=5, fused=True), (logits,))


def test_model_training_step_with_and_without_the_cpp_ops(monkeypatch):
    """Loss and every parameter gradient of a tiny model agree whether the mHC sites use the C++ ops or not."""
    cfg = GLMConfig.preset("tiny", hc_streams=4, n_layers=2)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))

    def step(use_cpp: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        monkeypatch.setattr(cext, "available", lambda: use_cpp)
        torch.manual_seed(0)
        model = GLMModel(cfg)
        out = model(ids[:, :-1])
        loss = F.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten()) + out.aux_loss
        loss.backward()
        return loss.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}

    loss_cpp, grads_cpp = step(True)
    loss_eager, grads_eager = step(False)
    torch.testing.assert_close(loss_cpp, loss_eager, atol=1e-5, rtol=1e-5)
    assert grads_cpp.keys() == grads_eager.keys()
    assert any(k.endswith("hc_mixer.phi") for k in grads_cpp)
    for k in grads_cpp:
        torch.testing.assert_close(grads_cpp[k], grads_eager[k], atol=1e-5, rtol=1e-4, msg=k)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("GLM_LIGHTNING_EXT", "0")
    assert not cext.enabled()
    monkeypatch.setenv("GLM_LIGHTNING_EXT", "auto")
    assert cext.enabled()


class _StreamWriteReference:
    """The stream write's PyTorch form (its reference, autograd for the backward), with a Function's ``apply``."""

    apply = staticmethod(reference.stream_write)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("dim", [7, 40])
def test_stream_ops_equal_the_eager_forms_and_gradcheck(n, dim):
    """csrc/streams.cpp: the read h = sum_i pre_i x_i and the write res x + post^T y against mhc.py's eager forms, with
    n known at compile time (2, 4) or not (3), channels past the last full vector (7) and whole vectors too (40)."""
    StreamReadFused, StreamWriteFused = mhc_ops._StreamReadCpp, mhc_ops._StreamWriteCpp
    StreamWrite = _StreamWriteReference
    torch.manual_seed(n)
    shapes = ((2, 5, n, n), (2, 5, n, dim), (2, 5, n), (2, 5, dim))
    args = [torch.randn(s, requires_grad=True) for s in shapes]
    post_view = torch.randn(2, 5, 2 * n)[..., n:].requires_grad_()  # a strided slice, as `gates.split` gives
    for fused, eager, inputs in ((StreamWriteFused, StreamWrite, args),
                                 (StreamWriteFused, StreamWrite, [args[0], args[1], post_view, args[3]]),
                                 (StreamReadFused, None, [args[2], args[1]])):
        out_f = fused.apply(*inputs)
        out_e = eager.apply(*inputs) if eager else read_streams(*inputs)
        torch.testing.assert_close(out_f, out_e, atol=1e-5, rtol=1e-5)
        w = torch.randn_like(out_e)
        for a, b in zip(torch.autograd.grad((out_f * w).sum(), inputs), torch.autograd.grad((out_e * w).sum(), inputs)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    dbl = [a.detach().double().requires_grad_() for a in args]
    assert torch.autograd.gradcheck(StreamWriteFused.apply, dbl)
    assert torch.autograd.gradcheck(StreamReadFused.apply, (dbl[2], dbl[1]))


@pytest.mark.parametrize("n,dim", [(2, 6), (4, 6), (2, 48), (4, 192)])
def test_cpp_site_read_equals_the_eager_mappings_and_read(n, dim, monkeypatch):
    """SiteReadFused (csrc/site_read.cpp: norm, projection, gates and read in one pass; Sinkhorn) against the eager
    composite of `mappings` + `read_streams`, at odd widths and the models' (2 x 48, 4 x 192), 10 tokens (a full and a
    partial block of 8): outputs and the gradients of x, phi, alpha and bias within 1e-5; gradcheck in fp64."""
    from glm_lightning.model.mhc import HyperConnection

    torch.manual_seed(n)
    site = HyperConnection(n=n, dim=dim, iters=7, site_index=1)
    with torch.no_grad():  # away from the init so every term (alpha, the norm) matters
        site.alpha.normal_(0.0, 1.0)
        site.bias.normal_(0.0, 1.0)
    x = torch.randn(2, 5, n, dim)
    ws = [torch.randn(2, 5, dim), torch.randn(2, 5, n), torch.randn(2, 5, n, n)]

    def run(use_cpp: bool):
        monkeypatch.setattr(cext, "available", lambda: use_cpp)
        xs = x.clone().requires_grad_()
        h, (post, res, _) = site.read(xs)
        params = [site.phi, site.alpha, site.bias]
        loss = sum((t * w).sum() for t, w in zip((h, post, res), ws))
        return (h, post, res), torch.autograd.grad(loss, [xs, *params])

    (outs_f, grads_f), (outs_e, grads_e) = run(True), run(False)
    for a, b in zip(outs_f, outs_e):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    for name, a, b in zip(["x", "phi", "alpha", "bias"], grads_f, grads_e):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"grad {name}: {m}")
    monkeypatch.setattr(cext, "available", lambda: True)
    site.double()
    xd = torch.randn(3, n, dim, dtype=torch.float64, requires_grad=True)

    def f(xx, phi, alpha, bias):
        return mhc_ops._SiteReadCpp.apply(xx, phi, alpha, bias, site._alpha_index, site._gate_scale, site._gate_shift,
                                          site.norm_eps, site.iters, site.eps)

    args = (xd, site.phi.detach().clone().requires_grad_(), site.alpha.detach().clone().requires_grad_(),
            site.bias.detach().clone().requires_grad_())
    assert torch.autograd.gradcheck(f, args, fast_mode=dim > 6)


@pytest.mark.parametrize("n,dim", [(2, 6), (3, 40), (4, 192)])
def test_the_write_gradient_of_the_streams_joins_the_read_backward_bit_for_bit(n, dim):
    """The write takes the x that the read passes on (site_read(streams_out=True)): the read's backward adds the write's
    gradient of the streams to its own while each block is in cache (site_read_backward's dx_acc) and gives exactly
    autograd's sum of the two (the write taking x itself), and the same parameter gradients; 18 tokens: partial
    blocks of 8."""
    from glm_lightning.model.mhc import HyperConnection

    torch.manual_seed(n)
    site = HyperConnection(n=n, dim=dim, iters=5, site_index=1)
    with torch.no_grad():
        site.alpha.normal_(0.0, 1.0)
        site.bias.normal_(0.0, 1.0)
    x, w = torch.randn(2, 9, n, dim), torch.randn(2, 9, n, dim)

    def grads(write_takes_the_passed_x: bool) -> tuple[torch.Tensor, ...]:
        xs = x.clone().requires_grad_()
        with mock.patch.object(mhc_ops, "LINK_WRITES", False):
            h, (post, res, xw) = site.read(xs)
        assert xw is not xs and torch.equal(xw, xs)
        out = mhc_ops.stream_write(res, xw if write_takes_the_passed_x else xs, post, torch.tanh(h))
        return torch.autograd.grad((out * w).sum(), [xs, site.phi, site.alpha, site.bias])

    for name, a, b in zip(["x", "phi", "alpha", "bias"], grads(True), grads(False)):
        assert torch.equal(a, b), name
    xs = x.clone().requires_grad_()  # only h used: the other outputs' gradients are None, read as zeros
    h_only = torch.autograd.grad((site.read(xs)[0] * w[..., 0, :]).sum(), xs)[0]
    xs = x.clone().requires_grad_()
    h, (post, res, _) = site.read(xs)
    unused = 0 * (post.sum() + res.sum())
    assert torch.equal(h_only, torch.autograd.grad((h * w[..., 0, :]).sum() + unused, xs)[0])


@pytest.mark.parametrize("n,dim", [(2, 6), (3, 40), (4, 192)])
def test_the_linked_write_gives_the_unlinked_gradients_bit_for_bit(n, dim):
    """A linked site (StreamsLink: the write's backward passes its output gradient on, the read's backward forms the
    write's gradients of H_res and of the streams) gives exactly the unlinked site's gradients: alone, with other
    consumers of H_res and H_post, with the link left unused (the write taking x itself), and with no gradient
    reaching the write; 2 x 41 tokens: two chunks of the linked backward and partial blocks of 8 and 16."""
    from glm_lightning.model.mhc import HyperConnection

    torch.manual_seed(10 + n)
    site = HyperConnection(n=n, dim=dim, iters=5, site_index=1)
    with torch.no_grad():
        site.alpha.normal_(0.0, 1.0)
        site.bias.normal_(0.0, 1.0)
    x, w = torch.randn(2, 41, n, dim), torch.randn(2, 41, n, dim)
    wr, wp = torch.randn(2, 41, n, n), torch.randn(2, 41, n)
    params = [site.phi, site.alpha, site.bias]

    def grads(linked: bool, case: str) -> tuple[torch.Tensor, ...]:
        xs = x.clone().requires_grad_()
        with mock.patch.object(mhc_ops, "LINK_WRITES", linked):
            h, (post, res, xw) = site.read(xs)
        assert isinstance(xw, mhc_ops.StreamsLink) == linked
        out = mhc_ops.stream_write(res, xs if case == "unused link" else xw, post, torch.tanh(h))
        loss = (out * w).sum()
        if case == "other consumers":
            loss = loss + (res * wr).sum() + (post * wp).sum()
        if case == "no write gradient":
            loss = (h * w[..., 0, :]).sum() + (res * wr).sum()
        return torch.autograd.grad(loss, [xs, *params])

    for case in ("alone", "other consumers", "unused link", "no write gradient"):
        for name, a, b in zip(["x", "phi", "alpha", "bias"], grads(True, case), grads(False, case)):
            assert torch.equal(a, b), (case, name)
    h, (post, res, link) = site.read(x.clone().requires_grad_())
    mhc_ops.stream_write(res, link, post, h)
    with pytest.raises(RuntimeError, match="one write"):
        mhc_ops.stream_write(res, link, post, h)


def test_stream_write_backward_linked_equals_the_full_backward_bit_for_bit():
    """The linked write's backward op (d H_post, d y only) gives the full backward's values bit for bit, 4 streams and
    3 (its run-time count), a width with a partial vector."""
    for n, C in ((4, 192), (3, 37)):
        g, res, x, post, y = (torch.randn(50, n, C), torch.randn(50, n, n), torch.randn(50, n, C), torch.randn(50, n),
                              torch.randn(50, C))
        _, _, dpost, dy = torch.ops.glm_lightning.stream_write_backward(g, res, x, post, y)
        dpost_l, dy_l = torch.ops.glm_lightning.stream_write_backward_linked(g, post, y)
        assert torch.equal(dpost, dpost_l) and torch.equal(dy, dy_l)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n,dim,tokens", [(2, 6, 3), (4, 192, 16), (3, 48, 21)])
def test_site_read_decode_equals_the_two_ops_bit_for_bit(n, dim, tokens, dtype):
    """The decode step's read half as one op (site_read_decode: site read and Sinkhorn, alpha expanded inside) gives
    exactly the values of the autograd form's two ops (site_read, sinkhorn) at odd widths, partial token blocks of 8
    and of 16, fp32 and fp64; and the layer's no-grad read runs it."""
    from glm_lightning.model.mhc import HyperConnection

    torch.manual_seed(n + tokens)
    site = HyperConnection(n=n, dim=dim, iters=7, site_index=1).to(dtype)
    with torch.no_grad():
        site.alpha.normal_(0.0, 1.0)
        site.bias.normal_(0.0, 1.0)
    x = torch.randn(tokens, 1, n, dim, dtype=dtype)
    h_two, post_two, res_two, _ = mhc_ops._SiteReadCpp.apply(
        x.view(tokens, n, dim), site.phi, site.alpha, site.bias, site._alpha_index, site._gate_scale,
        site._gate_shift, site.norm_eps, site.iters, site.eps)
    with torch.no_grad():  # the layer's no-grad read (a decode step's)
        h, (post, res, _) = site.read(x)
    assert torch.equal(h.view(tokens, dim), h_two) and torch.equal(post.view(tokens, n), post_two)
    assert torch.equal(res.view(tokens, n, n), res_two)
    one = torch.ops.glm_lightning.site_read_decode(x.view(tokens, n, dim), site.phi.detach(), site.alpha.detach(), site._alpha_index,
               site.bias.detach(), site._gate_scale, site._gate_shift, site.norm_eps, site.iters, site.eps)
    for a, b in zip(one, (h_two, post_two, res_two)):
        assert a.dtype == dtype and torch.equal(a, b)


@pytest.mark.parametrize("n", [1, 5, 8])
def test_cpp_every_compiled_stream_count_and_the_saved_softmax(n):
    """The op is compiled for 1 to 8 streams (csrc/sinkhorn.cpp): each equals the eager form, and the second output
    is the row softmax the backward starts from."""
    torch.manual_seed(n)
    logits = (torch.randn(21, n, n) * 2.0).requires_grad_()
    out, soft = torch.ops.glm_lightning.sinkhorn(logits.detach(), 20, 1e-6)
    torch.testing.assert_close(soft, torch.softmax(logits.detach(), dim=-1), atol=1e-6, rtol=1e-6)
    eager = sinkhorn_knopp(logits, fused=False)
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(eager)
    (g_eager,) = torch.autograd.grad(eager, logits, grad)
    g_fused = torch.ops.glm_lightning.sinkhorn_backward(grad, soft, 20, 1e-6)
    torch.testing.assert_close(g_fused, g_eager, atol=1e-5, rtol=1e-5)


def test_more_streams_than_the_ops_take_run_the_eager_paths():
    """9 streams: Sinkhorn falls back to the PyTorch form; a 7-stream site (past the
    C++ site read's 6) reads through the eager mappings, and a 9-stream site (past the C++ stream ops' 8) reads and
    writes through the eager forms, forward and backward, instead of failing."""
    from glm_lightning.model.mhc import HyperConnection

    logits = torch.randn(3, 9, 9)
    torch.testing.assert_close(sinkhorn_knopp(logits), sinkhorn_knopp(logits, fused=False))
    with pytest.raises(RuntimeError, match="1 to 8 streams"):
        torch.ops.glm_lightning.sinkhorn(logits, 20, 1e-6)
    for n in (7, 9):
        site = HyperConnection(n=n, dim=4, iters=3)
        x = torch.randn(2, 3, n, 4, requires_grad=True)
        h, maps = site.read(x)
        assert h.shape == (2, 3, 4) and maps[1].shape == (2, 3, n, n)
        out = site.write(x, maps, torch.tanh(h))
        assert out.shape == x.shape
        out.sum().backward()
        assert x.grad is not None and site.phi.grad is not None
