"""The mHC ops' large outputs (csrc/streams.cpp stream_write, csrc/site_read.cpp's chunked backward): stored past the
cache (kernel_helpers.h store_streaming) once an output exceeds 4 MB. Each token's output depends on that token alone,
so a large call must give bit for bit what calls on small slices of it give (ordinary stores), and the eager forms'
values within fp32 tolerance; 1,401 tokens (5.2 MB of streams): partial chunks and blocks at the end."""

import pytest
import torch

from glm_lightning.model import cext

pytestmark = pytest.mark.skipif(not cext.available(), reason="C++ ops disabled (GLM_LIGHTNING_EXT=0) or not buildable")

N, n, C = 1401, 4, 192
SLICE = 200  # tokens per small call: 0.6 MB, under the streaming size


def slices(fn, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """fn over SLICE-token slices of the token-major tensors, each of its outputs concatenated over the slices."""
    parts = [fn(*(t[s:s + SLICE] for t in tensors)) for s in range(0, N, SLICE)]
    parts = [p if isinstance(p, tuple | list) else (p,) for p in parts]
    return [torch.cat(outs) for outs in zip(*parts)]


def test_stream_write_large_equals_small_calls_and_the_eager_form():
    g = torch.Generator().manual_seed(0)
    res, x, post, y = (torch.randn(N, n, n, generator=g), torch.randn(N, n, C, generator=g),
                       torch.randn(N, n, generator=g), torch.randn(N, C, generator=g))
    out = torch.ops.glm_lightning.stream_write(res, x, post, y)
    assert out.numel() * 4 > 4 << 20
    assert torch.equal(out, slices(torch.ops.glm_lightning.stream_write, res, x, post, y)[0])
    torch.testing.assert_close(out, res @ x + post.unsqueeze(-1) * y.unsqueeze(-2), rtol=1e-5, atol=1e-5)


def site_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A site read's saved tensors and its output gradients (the linked write's g among them)."""
    L = n * n + 2 * n
    x, phi = torch.randn(N, n, C, generator=gen), torch.randn(L, n * C, generator=gen) * 0.02
    alpha_e, bias = torch.randn(L, generator=gen), torch.randn(L, generator=gen)
    scale, shift = torch.tensor([1.0] * n + [2.0] * n), torch.tensor([1e-6] * n + [0.0] * n)
    _, gates, logits, inv, raw, sig = torch.ops.glm_lightning.site_read(x, phi, alpha_e, bias, scale, shift, 1e-5)
    res, soft = torch.ops.glm_lightning.sinkhorn(logits, 5, 1e-6)
    return dict(x=x, phi=phi, alpha_e=alpha_e, scale=scale, gates=gates, inv=inv, raw=raw, sig=sig, res=res, soft=soft,
                dh=torch.randn(N, C, generator=gen), dpost=torch.randn(N, n, generator=gen),
                g=torch.randn(N, n, C, generator=gen), dres=torch.randn(N, n, n, generator=gen))


@pytest.mark.parametrize("linked", [True, False])
def test_site_read_backward_large_equals_small_calls(linked):
    """dx bit for bit (per token); dphi, dbias, dalpha (sums over the tokens, in another grouping) within tolerance."""
    d = site_inputs(torch.Generator().manual_seed(1))
    ops = torch.ops.glm_lightning
    if linked:
        def backward(dh, dpost, g, res, soft, dres, x, gates, inv, raw, sig):
            return ops.site_read_backward_linked(dh, dpost, dres, g, res, soft, 5, 1e-6, x, d["phi"], d["alpha_e"],
                                                 d["scale"], inv, raw, sig, gates)
    else:  # the unlinked op with the write's gradient of the streams (g as dx_acc) added
        def backward(dh, dpost, g, res, soft, dres, x, gates, inv, raw, sig):
            return ops.site_read_backward(dh, dpost, dres, x, d["phi"], d["alpha_e"], d["scale"], inv, raw, sig,
                                          gates, g)
    names = ("dh", "dpost", "g", "res", "soft", "dres", "x", "gates", "inv", "raw", "sig")
    big = backward(*(d[k] for k in names))
    small = slices(backward, *(d[k] for k in names))
    assert big[0].numel() * 4 > 4 << 20
    assert torch.equal(big[0], small[0])
    for a, parts in zip(big[1:], small[1:]):
        total = sum(parts.view(-1, *a.shape)) if parts.shape != a.shape else parts
        torch.testing.assert_close(a, total, rtol=1e-4, atol=1e-4)
