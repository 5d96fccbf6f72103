"""KDA's chunkwise-parallel (WY / UT) core, the paper's training algorithm, as one autograd Function with a
hand-written backward: the form of the core for heads the C++ recurrence does not take, or without the C++ ops.
Equal to ``reference.kda_recurrent`` within float rounding.

Inside a chunk of C tokens, with the in-chunk ``G = cumsum(g)`` and ``Gamma = exp(G)``::

    M[i, j]   = sum_d k_id k_jd exp(G_id - G_jd)        (j < i)
    A         = (I + diag(beta) M)^-1 diag(beta)           (unit-lower triangular solve)
    U = A V,  W = A (Gamma * K)
    Aqk[r, j] = sum_d q_rd k_jd exp(G_rd - G_jd)        (j <= r)
    O         = (Gamma * Q) S + Aqk (U - W S)
    S'        = Diag(Gamma_C) S + ((Gamma_C / Gamma) * K)^T (U - W S)

Everything except the state hand-off is computed for all chunks at once; the hand-off is ``S' = P S + R`` with
``P = Diag(Gamma_C) - ((Gamma_C/Gamma) K)^T W`` and ``R = ((Gamma_C/Gamma) K)^T U``, one batched matmul-add per chunk
(:func:`scan`, or one C++ op per direction). fp32 safety of the factorised ``exp(G_i - G_j) = exp(G_i - ref)
exp(ref - G_j)``: the reference is taken per row block of at most 16 rows (fewer if the gate bound needs it), at the
block's first row, so each factor stays below ``exp(|lb| (s - 1))`` (75 for lb = -5, s = 16) and the layer is causal
bit for bit. Masked (future) entries are removed with ``masked_fill`` on finite values, and future exponents are zeroed
before the ``exp``, so no inf reaches autograd.

Why the hand-written backward: left to autograd the chunked form recorded ~100 nodes per layer and replayed them as
~600 dispatched ops; written out on flat chunk-major ``[X, C, D]`` tensors (X = chunks * batch * heads) it is ~4x fewer.
With ``e_row = exp(G_i - ref_a)``, ``e_col = exp(ref_a - G_j)``, ``kr = k e_row``, ``qr = q e_row``, ``kcol = k e_col``:

    M = kr kcol^T (j < i),  Aqk = qr kcol^T (j <= i),  L = diag(beta) M (unit diagonal implied),
    UW = L^-1 diag(beta) [V | Gam K],  RP = (K dec)^T UW,  P = diag(Gam_C) - RP_K,  R = RP_V,
    O = OQ_V + Q_eff S_in,  OQ = Aqk UW,  Q_eff = Gam Q - OQ_K,  S_{n+1} = P_n S_n + R_n.

Backward, in reverse: dQ_eff = dO S_in^T, dS_n from the reversed hand-off, dR = dS_{n+1}, dP = dS_{n+1} S_n^T;
dOQ = [dO | -dQ_eff]: dAqk = dOQ UW^T, dUW = Aqk^T dOQ + (K dec) [dR | -dP]; dB = L^-T dUW, dL = -dB UW^T (strictly
lower), dM = beta dL, dbeta = rowsum(dL M) + rowsum(dB [V | Gam K]); then the factor products and dg = reverse cumsum
of dG.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from glm_lightning.model.ops import backend, mixed_precision as mp

__all__ = ["kda_chunked", "scan", "scan_backward"]


@functools.lru_cache(maxsize=64)
def _above(C: int, diagonal: int, device: torch.device) -> Tensor:
    """[C, C] bool, True strictly above the given diagonal: the entries a causal [C, C] matrix must not hold."""
    with torch.inference_mode(False):  # a normal tensor even if first built while decoding
        i = torch.arange(C, device=device)
        return i[None, :] - i[:, None] > diagonal


@functools.lru_cache(maxsize=64)
def _eye(C: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """[C, C] identity (cached): the right-hand side that turns the triangular solve into the inverse."""
    with torch.inference_mode(False):
        return torch.eye(C, dtype=dtype, device=device)


@functools.lru_cache(maxsize=64)
def _future_cols(ns: int, s: int, device: torch.device) -> Tensor:
    """[ns, C, 1] bool: column j lies after the end of row block a (cached)."""
    with torch.inference_mode(False):
        j = torch.arange(ns * s, device=device)
        a_end = (torch.arange(ns, device=device) + 1) * s
        return (j[None, :] >= a_end[:, None]).unsqueeze(-1)


def scan(P: Tensor, R: Tensor, S0: Tensor, cpp: bool) -> Tensor:
    """S_{n+1} = P_n S_n + R_n: P [N, M, K, K], R [N, M, K, V], S0 [M, K, V] -> all states [N + 1, M, K, V]."""
    if cpp:
        return torch.ops.glm_lightning.state_scan(P, R, S0)
    S_all = R.new_empty(P.shape[0] + 1, *S0.shape)
    S_all[0] = S0
    for n in range(P.shape[0]):
        torch.baddbmm(R[n], P[n], S_all[n], out=S_all[n + 1])
    return S_all


def scan_backward(grad: Tensor, P: Tensor, cpp: bool) -> Tensor:
    """The total dL/dS_n from the direct ones, grad [N + 1, M, K, V]: g_n = grad_n + P_n^T g_{n+1} (a new tensor)."""
    if cpp:
        return torch.ops.glm_lightning.state_scan_backward(grad, P)
    g = grad.clone()
    for n in reversed(range(P.shape[0])):
        g[n].baddbmm_(P[n].transpose(1, 2), g[n + 1])
    return g


def _to_chunks(x: Tensor, N: int, C: int) -> Tensor:
    """[B, T, H, D] -> [N*B*H, C, D] chunk-major and contiguous, T zero-padded to N*C (identity steps). One copy into
    a permuted view of the result (6 dispatched ops; reshape-permute-reshape is 10), also from a strided x (a
    reshape there had copied it twice: the study model's core took 3.4 instead of 2.4 ms)."""
    B, T, H, D = x.shape
    if N * C != T:
        x = F.pad(x, (0, 0, 0, 0, 0, N * C - T))
    out = torch.empty(N * B * H, C, D, dtype=x.dtype, device=x.device)
    # unflatten splits T without a copy whatever x's strides (q, k, v, g are views of the features)
    out.view(N, B, H, C, D).permute(1, 0, 3, 2, 4).copy_(x.unflatten(1, (N, C)))
    return out


def _from_chunks(x: Tensor, B: int, H: int, T: int) -> Tensor:
    """[N*B*H, C, D] -> [B, T, H, D] (the padded tail dropped)."""
    X, C, D = x.shape
    N = X // (B * H)
    out = torch.empty(B, N * C, H, D, dtype=x.dtype, device=x.device)
    out.view(B, N, C, H, D).copy_(x.view(N, B, H, C, D).permute(1, 0, 3, 2, 4))
    return out if N * C == T else out[:, :T]


class _KDAChunked(torch.autograd.Function):
    """(q, k, v, g, beta, S0, chunk, row blocks, C++ hand-off) -> (o [B, T, H, V], final state [B, H, K, V]).

    Inputs as :func:`kda_chunked` takes them, already in the compute dtype; ``ns`` row blocks
    per chunk for the factorised exp; ``cpp`` picks the C++ hand-off.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S0: Tensor,  # type: ignore[override]
                C: int, ns: int, cpp: bool) -> tuple[Tensor, Tensor]:
        B, T, H, K = q.shape
        V = v.shape[-1]
        N, s = -(-T // C), C // ns
        X = N * B * H
        q, k, v, g, beta = (_to_chunks(x, N, C) for x in (q, k, v, g, beta.unsqueeze(-1)))
        G = g.cumsum(1)                                                          # [X, C, K]
        Gb = G.view(X, ns, s, K)
        ref = Gb[:, :, :1]                                                       # [X, ns, 1, K]
        e_row = (Gb - ref).exp_()                                                # [X, ns, s, K], <= 1
        e_col = (ref - G.unsqueeze(1)).masked_fill_(_future_cols(ns, s, q.device), 0.0).exp_()  # [X, ns, C, K]
        # row blocks flattened into the batch: [X*ns, s, K] rows against [X*ns, C, K] columns, plain bmm
        kcol = (k.unsqueeze(1) * e_col).view(X * ns, C, K)
        kr, qr = (k.view(X, ns, s, K) * e_row).view(X * ns, s, K), (q.view(X, ns, s, K) * e_row).view(X * ns, s, K)
        kcol_t = kcol.transpose(1, 2)
        M = torch.bmm(kr, kcol_t).view(X, C, C).masked_fill_(_above(C, -1, q.device), 0.0)
        Aqk = torch.bmm(qr, kcol_t).view(X, C, C).masked_fill_(_above(C, 0, q.device), 0.0)
        Gam = G.exp()
        VK = torch.cat([v, Gam * k], dim=-1)                                     # [V | Gamma K]   [X, C, V+K]
        # A = L^-1 (L = I + diag(beta) M) once as a matrix: UW = A (beta VK) and, in backward, dB = A^T dUW are then
        # plain bmm (a triangular solve is a dozen dispatched ops of layout copies)
        A = torch.linalg.solve_triangular(M * beta, _eye(C, q.dtype, q.device), upper=False, unitriangular=True)
        UW = torch.bmm(A, beta * VK)
        dec = (G[:, -1:] - G).exp_()                                             # Gamma_C / Gamma
        k_dec = k * dec
        RP = torch.bmm(k_dec.transpose(1, 2), UW)                                # [R | K_dec^T W]  [X, K, V+K]
        P = RP[..., V:].neg()
        P.diagonal(dim1=1, dim2=2).add_(Gam[:, -1])                              # diag(Gamma_C) - K_dec^T W
        OQ = torch.bmm(Aqk, UW)                                                  # [Aqk U | Aqk W]
        Q_eff = torch.addcmul(OQ[..., V:].neg(), Gam, q)                         # Gamma Q - Aqk W
        S_all = scan(P.view(N, B * H, K, K), RP[..., :V].reshape(N, B * H, K, V), S0.reshape(B * H, K, V), cpp)
        o = torch.baddbmm(OQ[..., :V], Q_eff, S_all[:N].view(X, K, V))
        ctx.save_for_backward(q, k, beta, Gam, e_row, e_col, kr, qr, kcol, M, A, Aqk, VK, UW, dec, k_dec, Q_eff,
                              P, S_all)
        ctx.dims = (B, T, H, K, V, N, C, ns, cpp)
        return _from_chunks(o, B, H, T), S_all[N].view(B, H, K, V).clone()

    @staticmethod
    @mp.autocast_off_backward
    def backward(ctx, dO: Tensor, dS_last: Tensor):  # type: ignore[override]
        q, k, beta, Gam, e_row, e_col, kr, qr, kcol, M, A, Aqk, VK, UW, dec, k_dec, Q_eff, P, S_all = ctx.saved_tensors
        B, T, H, K, V, N, C, ns, cpp = ctx.dims
        X, s = N * B * H, C // ns
        dO = _to_chunks(dO, N, C)                                                # [X, C, V]
        S_in = S_all[:N].view(X, K, V)
        dQ_eff = torch.bmm(dO, S_in.transpose(1, 2))                             # [X, C, K]
        # the hand-off backward: direct dS_n = Q_eff^T dO for the chunk-start states, dS_last for the final one
        g_direct = torch.cat([torch.bmm(Q_eff.transpose(1, 2), dO), dS_last.reshape(B * H, K, V)])
        g_all = scan_backward(g_direct.view(N + 1, B * H, K, V), P.view(N, B * H, K, K), cpp)
        dR = g_all[1:].view(X, K, V)
        dP = torch.bmm(dR, S_in.transpose(1, 2))                                 # [X, K, K]
        # OQ = Aqk UW, read as [dO | -dQ_eff]; RP = K_dec^T UW, read as [dR | -dP]
        dOQ = torch.cat([dO, dQ_eff.neg()], dim=-1)
        dAqk = torch.bmm(dOQ, UW.transpose(1, 2)).masked_fill_(_above(C, 0, q.device), 0.0)
        dRP = torch.cat([dR, dP.neg()], dim=-1)
        dk_dec = torch.bmm(UW, dRP.transpose(1, 2))                              # [X, C, K]
        dUW = torch.bmm(Aqk.transpose(1, 2), dOQ).baddbmm_(k_dec, dRP)
        # UW = L^-1 (beta VK)
        dBr = torch.bmm(A.transpose(1, 2), dUW)
        dL = torch.bmm(dBr, UW.transpose(1, 2)).masked_fill_(_above(C, -1, q.device), 0.0)  # -dL/dL, strictly lower
        dbeta = (dBr * VK).sum(-1, keepdim=True).sub_((dL * M).sum(-1, keepdim=True))
        dVK = dBr.mul_(beta)
        dM = dL.mul_(beta.neg())
        # the factor products of M = kr kcol^T and Aqk = qr kcol^T, per row block
        dM_b, dA_b = dM.view(X * ns, s, C), dAqk.view(X * ns, s, C)
        d_kr, d_qr = torch.bmm(dM_b, kcol), torch.bmm(dA_b, kcol)                # [X*ns, s, K]
        d_kcol = torch.bmm(dM_b.transpose(1, 2), kr).baddbmm_(dA_b.transpose(1, 2), qr).view(X, ns, C, K)
        d_kcol_e = (d_kcol * e_col).sum(1)                                       # [X, C, K]
        dG = (d_kr * kr).add_(d_qr * qr).view(X, C, K).sub_((d_kcol * kcol.view(X, ns, C, K)).sum(1))
        # Gamma enters Q_eff (Gam q) and VK (Gam k); dec = exp(G_C - G) enters K_dec; diag(Gamma_C) enters P
        dGk = dVK[..., V:]
        dGam = torch.addcmul(dQ_eff * q, dGk, k)
        dG.addcmul_(dGam, Gam)
        dkd = dk_dec * k_dec
        dG.sub_(dkd)
        dG[:, -1].add_(dkd.sum(1)).addcmul_(dP.diagonal(dim1=1, dim2=2), Gam[:, -1])
        e_row = e_row.view(X * ns, s, K)
        dq = (d_qr * e_row).view(X, C, K).addcmul_(dQ_eff, Gam)
        dk = (d_kr * e_row).view(X, C, K).add_(d_kcol_e).addcmul_(dk_dec, dec).addcmul_(dGk, Gam)
        dg = dG.flip(1).cumsum(1).flip(1)                                        # G = cumsum(g)
        dv = dVK[..., :V]
        grads = (_from_chunks(t, B, H, T) for t in (dq, dk, dv, dg, dbeta))
        dq, dk, dv, dg, dbeta = grads
        return dq, dk, dv, dg, dbeta.squeeze(-1), g_all[0].view(B, H, K, V), None, None, None


_EXP_LIMIT = 80.0
"""Largest exponent the factorised exp may reach inside a row block (fp32 exp overflows above ~88.7)."""


def _n_row_blocks(C: int, gate_bound: float, max_rows: int = 16) -> int:
    """Number of row blocks of the factorised exp: the smallest divisor ns of C whose blocks of s = C / ns rows have
    s <= max_rows and (s - 1) * gate_bound <= _EXP_LIMIT."""
    ns = 1
    while C % ns or C // ns > max_rows or (C // ns - 1) * gate_bound > _EXP_LIMIT:
        ns += 1
    return ns


@mp.fp32_op
def kda_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int = 32,
                initial_state: Tensor | None = None, *, gate_bound: float | None = None,
                cpp: bool | None = None) -> tuple[Tensor, Tensor]:
    """The chunked core, with the shapes and results of ``reference.kda_recurrent``. T is padded to a multiple of
    ``chunk_size`` with identity steps. ``gate_bound`` bounds ``|g|`` (the safe gate's ``|lb|``) and sets the row
    blocks of the factorised exp; None reads it from the data (``max(-g)``). ``cpp`` picks the chunk hand-off: the
    C++ op (True), the PyTorch loop (False), or the C++ op when it takes the tensors (None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    ins = (q, k, v, g, beta, *(() if initial_state is None else (initial_state,)))
    dt = torch.float64 if any(x.dtype == torch.float64 for x in ins) else torch.float32
    S = q.new_zeros(B, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)
    if T == 0:
        return v.new_zeros(B, 0, H, V, dtype=dt), S
    q, k, v, g, beta = (x if x.dtype == dt else x.to(dt) for x in (q, k, v, g, beta))
    if gate_bound is None:
        gate_bound = float(-g.detach().min().clamp(max=0.0))
    ns = _n_row_blocks(chunk_size, abs(gate_bound))
    use_cpp = backend.takes(q) if cpp is None else cpp
    return _KDAChunked.apply(q, k, v, g, beta, S, chunk_size, ns, use_cpp)
