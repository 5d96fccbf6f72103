"""Cached generation: prefill once, replicate the caches for G samples, decode token by token (nanochat's engine
pattern, arXiv-free). KDA layers carry a constant-size recurrent state + short-conv buffer; DSA layers carry
preallocated K/V and indexer-key buffers (sized to prompt + budget, not the whole context) and pick top-k cached
keys per new token.

Ragged prompts are left-padded (so every row's next token sits at the same column); pad positions are marked
invalid, which makes them identity steps for KDA and masked keys for DSA, so a padded row generates exactly what it
would generate alone.

Large batches (RL: every prompt x G samples in one prefill and one decode loop) lose most of their rows early, so
finished rows are dropped from the batch: once enough of the batch is finished, every cache tensor keeps only the
live rows (`ModelCache.index_select`). Until then a finished row feeds an invalid pad token, which leaves its state
untouched. Sampling draws its noise for every original row at every step (the exponential race that
`torch.multinomial` runs internally, so the tokens are bit-identical to it), which makes the tokens independent of
when, or whether, rows are dropped.

`precision="bf16"` samples from a copy of the model whose matrices are rounded to bf16 (`sampling_weights`:
refreshed whenever the model's parameters changed since, e.g. after every optimizer step of RL). Vectors (norm scales,
biases, gate offsets), the caches, the prefill and every op but the decode's matmuls stay fp32. The decode steps read
the matrices as bf16 panels (half the bytes a step streams; ops.matmul.packed, csrc/panel_matmul.cpp) and multiply
them with their input rounded to bf16 (nearest even): bf16 x times bf16 W, summed in fp32, bias added in fp32, output
fp32 (what autocast's bf16 linear computes, minus its output rounding). The same math on every CPU: on AMX tiles
where the CPU has AMX-BF16 (within fp32 summation order), else widened to fp32 FMAs (bit for bit fp32 panels of the
rounded weights applied to the rounded input).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from glm_lightning.model.cache import ModelCache
from glm_lightning.model.dsa import DSACache
from glm_lightning.precision import PRECISIONS
from glm_lightning.tokenizer import ByteTokenizer

_TOK = ByteTokenizer()
NEWLINE = ord("\n")


@dataclass
class Generation:
    tokens: torch.Tensor
    """[B * num_samples, T_new] completion tokens; after a row's eos (kept) every slot holds pad."""
    logprobs: torch.Tensor
    """[B * num_samples, T_new] log-prob of each sampled token under the sampling distribution (0 after the end)."""
    lengths: torch.Tensor
    """[B * num_samples] number of generated tokens per row (including eos when emitted)."""


def left_align(prompt_ids: torch.Tensor,
               attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [B, T'] and their `valid` mask, the layout decoding needs (`ByteTokenizer.left_pad` makes it
    directly). `attention_mask` is bool [B, T], True on real tokens anywhere in a row (left, right or both sides
    padded); None means every token is real. Anything but a bool mask is refused: a lengths vector or a 0/1 int
    tensor would otherwise be read as token positions."""
    b, t = prompt_ids.shape
    if attention_mask is None:
        return prompt_ids, torch.ones_like(prompt_ids, dtype=torch.bool)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool \
            or attention_mask.shape != (b, t):
        got = (attention_mask.dtype, tuple(attention_mask.shape)) if isinstance(attention_mask, torch.Tensor) \
            else type(attention_mask).__name__
        raise TypeError(f"attention_mask must be a bool tensor [B, T] = [{b}, {t}] (True on real tokens), got {got}; "
                        "build it with ByteTokenizer.left_pad / encode_batch")
    mask = attention_mask
    lengths = mask.sum(1)
    if int(lengths.min()) < 1:
        raise ValueError("every prompt needs at least one real token")
    if bool(mask[:, -1].all()) and bool((mask.long().diff(dim=1) >= 0).all()):
        return prompt_ids[:, t - int(lengths.max()):], mask[:, t - int(lengths.max()):]  # already left-padded
    ids, valid = _TOK.left_pad([prompt_ids[row][mask[row]].tolist() for row in range(b)])
    return ids.to(prompt_ids.device), valid.to(prompt_ids.device)


COMPACT_FRACTION = 0.125
"""Drop finished rows once they are at least this share of the decode batch, and only if the decode steps they would
still cost before the budget ends add up to one full-batch step: copying the live rows' caches (fresh memory) took
0.4-0.8 of a decode step on flash-25m (1 thread, 512 rows, busy machine), so copies must stay rare and pay back."""


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_k: int | None,
                      top_p: float | None) -> torch.Tensor:
    """Log-probs [N, V] of the tempered, truncated sampling distribution (temperature > 0)."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.log_softmax(-1)


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None,
                noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token [N] and its log-prob under the (tempered, truncated) sampling distribution.

    Sampling is the exponential race argmax(p / E), E ~ Exp(1), exactly what `torch.multinomial(p, 1)` computes;
    `noise` [N, V] supplies E (drawn by the caller per original row, see `generate`), else it is drawn here."""
    if temperature == 0:
        tok = logits.float().argmax(-1)
        return tok, torch.zeros_like(tok, dtype=torch.float)
    logp = sampling_logprobs(logits, temperature, top_k, top_p)
    if noise is None:
        noise = torch.empty_like(logp).exponential_(1, generator=generator)
    tok = (logp.exp() / noise).argmax(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)




def check_precision(precision: str) -> str:
    """`precision` as one of PRECISIONS ("fp32"/"32-true" read as "32"), else a one-line ValueError."""
    value = {"fp32": "32", "32-true": "32", "bfloat16": "bf16"}.get(str(precision), str(precision))
    if value not in PRECISIONS:
        raise ValueError(f"generation precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    return value


_sampling_copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> (parameter versions, bf16 copy): the copy `sampling_weights` keeps per model."""


def _versions(model: torch.nn.Module) -> tuple[int, ...]:
    return tuple(p._version for p in model.parameters()) + tuple(id(p) for p in model.parameters())


def _is_matrix(p: torch.Tensor) -> bool:
    return p.dim() >= 2 and p.is_floating_point()


def sampling_weights(model: torch.nn.Module, precision: str = "32") -> torch.nn.Module:
    """The model generation samples from: `model` itself for "32"; for "bf16" a copy whose matrices (parameters of
    2 or more dims) hold their bf16-rounded values (stored as fp32) and whose vectors and buffers are `model`'s, kept
    per model and refreshed when a parameter changed since the last call, as its version counter tells: an in-place
    write bumps it, and so does the project's AdamW (optim.py) after its fused kernel; torch's own fused optimizers
    write without bumping it, so whoever steps one calls :func:`weights_changed` (RL does after every step).

    Why fp32 storage: the copy computes in fp32 (activations, the fp32 C++ ops, no casts between ops) while its cached
    decode packs the matrices as bf16 panels (`decode_weights`, ops.matmul.packed: half the bytes a step streams,
    widened in registers, exact), so bf16 costs no dispatched op and only the weights are rounded."""
    if check_precision(precision) == "32":
        return model
    key = _versions(model)  # (no bf16 GEMM runs: nothing is emulated on a CPU without native bf16, nothing to warn)
    held = _sampling_copies.get(model)
    with torch.inference_mode(False), torch.no_grad():
        if held is None:
            clone = copy.deepcopy(model).requires_grad_(False)
            clone.decode_weights = torch.bfloat16
            held = [None, clone]
            _sampling_copies[model] = held
        if held[0] != key:
            for src, dst in zip(model.parameters(), held[1].parameters()):
                dst.copy_(src.to(torch.bfloat16) if _is_matrix(src) else src)
            for src, dst in zip(model.buffers(), held[1].buffers()):
                dst.copy_(src)
            held[0] = key
    held[1].train(model.training)
    return held[1]


def weights_changed(model: torch.nn.Module) -> None:
    """Bump the version counter of every parameter of `model`: its weights were written in a way torch did not
    count (a fused optimizer kernel writes through data pointers, ``w.data[...] = ...``), and the caches keyed on the
    counters (:func:`sampling_weights`' bf16 copy; the decode's panels the model keeps between generations,
    model/kept_panels.py, which also see such writes when they move most of a weight) must see it."""
    torch.autograd.graph.increment_version(list(model.parameters()))


def decode_cache(model: torch.nn.Module, batch: int, length: int) -> ModelCache:
    """`model.new_cache(batch)` with DSA buffers `length` positions long (prompt + budget) instead of the whole
    context: less memory to replicate for G samples and to copy when rows are dropped."""
    cache = model.new_cache(batch)
    if length < model.cfg.max_seq_len:
        sized = dataclasses.replace(model.cfg, max_seq_len=length)
        cache.layers = [DSACache.empty(batch, sized, layer.k.device, layer.k.dtype) if isinstance(layer, DSACache)
                        else layer for layer in cache.layers]
    return cache


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    max_new_tokens: int = 48,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    num_samples: int = 1,
    eos_id: int | None = _TOK.eos_id,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
    stop_fn: Callable[[list[int]], bool] | None = None,
    banned_ids: Sequence[int] = (_TOK.pad_id, _TOK.bos_id, _TOK.image_start_id, _TOK.image_id, _TOK.image_end_id),
    compact: bool = True,
    precision: str = "32",
) -> Generation:
    """Sample `num_samples` completions per prompt with the model's decoding caches (see module docstring).

    `stop_fn(completion_tokens)` is asked only after a newline byte, so it may be moderately expensive (e.g. "does
    the completion parse as a complete function?"); returning True finishes that row. `attention_mask`: bool [B, T],
    True on real tokens (see `left_align`). `compact=False` keeps finished rows in the batch (same tokens, slower;
    tests and benchmarks compare the two). `precision`: "32" (the model's weights) or "bf16" (`sampling_weights`).
    """
    cfg = model.cfg
    model = sampling_weights(model, precision)
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2:
        raise ValueError("prompt_ids must be a LongTensor [B, T]")
    model.check_ids(prompt_ids)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError("top_k must be >= 1")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError("top_p must lie in (0, 1]")
    ids, valid = left_align(prompt_ids, attention_mask)
    if ids.shape[1] + max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"prompt length {ids.shape[1]} + max_new_tokens {max_new_tokens} exceeds the model "
                         f"context {cfg.max_seq_len}")
    was_training = model.training
    model.eval()
    try:
        cache = decode_cache(model, ids.shape[0], ids.shape[1] + max_new_tokens)
        logits = model(ids, valid=valid, cache=cache).logits[:, -1]
        if num_samples > 1:
            cache = cache.repeat_interleave(num_samples)
            logits = logits.repeat_interleave(num_samples, dim=0)
        with _no_gc_pauses():
            return _decode(model, cache, logits, max_new_tokens, temperature, top_k, top_p, eos_id, generator,
                           stop_fn, banned_ids, compact)
    finally:
        model.train(was_training)


@contextmanager
def _no_gc_pauses() -> Iterator[None]:
    """Python's cyclic garbage collector off for the decode loop (back as it was after): each step allocates a few
    hundred short-lived objects, enough to trigger collections that walked the whole heap (1-2% of a flash-25m 16-row
    step, perf samples, Intel Xeon, 1 thread); the loop makes no reference cycles, and reference counting still frees
    everything at once."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _decode(model: torch.nn.Module, cache: ModelCache, logits: torch.Tensor, max_new_tokens: int,
            temperature: float, top_k: int | None, top_p: float | None, eos_id: int | None,
            generator: torch.Generator | None, stop_fn: Callable[[list[int]], bool] | None,
            banned_ids: Sequence[int], compact: bool) -> Generation:
    """The decode loop. `rows[i]` is the output row of batch row i; `live[i]` is False once it finished (until the
    batch is compacted and the row leaves it)."""
    n, device = logits.shape[0], logits.device
    ban = torch.tensor(list(banned_ids), dtype=torch.long, device=device)
    tokens = torch.full((n, max_new_tokens), _TOK.pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((n, max_new_tokens), device=device)
    lengths = torch.zeros(n, dtype=torch.long, device=device)
    rows = torch.arange(n, device=device)
    live = torch.ones(n, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        if ban.numel():
            logits = logits.index_fill(-1, ban, float("-inf"))
        noise = None
        if temperature > 0:  # one draw per original row and step, whoever is still in the batch
            noise = torch.empty((n, logits.shape[-1]), device=device).exponential_(1, generator=generator)
            noise = noise if rows.shape[0] == n else noise.index_select(0, rows)
        tok, lp = sample_next(logits, temperature, top_k, top_p, generator, noise)
        sel = slice(None) if bool(live.all()) else live  # the batch rows still generating
        out = rows[sel]
        tokens[out, step], logprobs[out, step], lengths[out] = tok[sel], lp[sel], step + 1
        done = torch.zeros_like(live) if eos_id is None else tok == eos_id
        if stop_fn is not None:
            for i in torch.nonzero((tok == NEWLINE) & live).flatten().tolist():
                if stop_fn(tokens[int(rows[i]), : step + 1].tolist()):
                    done[i] = True
        live &= ~done
        n_live = int(live.sum())
        if n_live == 0 or step == max_new_tokens - 1:
            break
        dead, remaining = live.shape[0] - n_live, max_new_tokens - step - 1
        if compact and dead >= COMPACT_FRACTION * live.shape[0] and dead * remaining >= live.shape[0]:
            keep = torch.nonzero(live).flatten()
            cache, rows, tok = cache.index_select(keep), rows[keep], tok[keep]
            live = torch.ones(n_live, dtype=torch.bool, device=device)
        # finished rows still in the batch step on a pad token as real rows: rows never mix (each row's outputs are
        # bit for bit those of its batch alone), nobody reads a finished row's cache, and the decode's fast path
        # takes no padding mask (with one, every op ran its general form: a step ~1.5x slower)
        logits = model(tok.masked_fill(~live, _TOK.pad_id)[:, None], cache=cache).logits[:, -1]
    return Generation(tokens=tokens, logprobs=logprobs, lengths=lengths)


@torch.inference_mode()
def generate_naive(model: torch.nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int = 48,
                   eos_id: int | None = _TOK.eos_id) -> torch.Tensor:
    """Greedy reference: re-run the full forward over the whole prefix for every new token (no caches).

    Used by tests (cached == naive) and as the benchmark baseline; rows must share one length.
    """
    was_training = model.training
    model.eval()
    seq = prompt_ids.clone()
    out = torch.full((seq.shape[0], max_new_tokens), _TOK.pad_id, dtype=torch.long)
    finished = torch.zeros(seq.shape[0], dtype=torch.bool)
    banned = [_TOK.pad_id, _TOK.bos_id, _TOK.image_start_id, _TOK.image_id, _TOK.image_end_id]
    for step in range(max_new_tokens):
        logits = model(seq).logits[:, -1].float()
        logits[:, banned] = float("-inf")
        tok = logits.argmax(-1).masked_fill(finished, _TOK.pad_id)
        out[:, step] = tok
        if eos_id is not None:
            finished |= tok == eos_id
        if bool(finished.all()):
            break
        seq = torch.cat([seq, tok[:, None]], dim=1)
    model.train(was_training)
    return out
