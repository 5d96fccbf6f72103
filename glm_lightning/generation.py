"""Cached generation: prefill once, replicate the caches for G samples, decode token by token (nanochat's engine
pattern, arXiv-free). KDA layers carry a constant-size recurrent state + short-conv buffer; DSA layers carry
preallocated K/V and indexer-key buffers and pick top-k cached keys per new token.

Ragged prompts are left-padded (so every row's next token sits at the same column); pad positions are marked
invalid, which makes them identity steps for KDA and masked keys for DSA, so a padded row generates exactly what it
would generate alone. Finished rows keep feeding invalid pad tokens, which leaves their state untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

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


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token [N] and its log-prob under the (tempered, truncated) sampling distribution."""
    logits = logits.float()
    if temperature == 0:
        tok = logits.argmax(-1)
        return tok, torch.zeros_like(tok, dtype=torch.float)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    logp = logits.log_softmax(-1)
    tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


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
) -> Generation:
    """Sample `num_samples` completions per prompt with the model's decoding caches (see module docstring).

    `stop_fn(completion_tokens)` is asked only after a newline byte, so it may be moderately expensive (e.g. "does
    the completion parse as a complete function?"); returning True finishes that row. `attention_mask`: bool [B, T],
    True on real tokens (see `left_align`).
    """
    cfg = model.cfg
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
        cache = model.new_cache(ids.shape[0])
        logits = model(ids, valid=valid, cache=cache).logits[:, -1]
        if num_samples > 1:
            cache = cache.repeat_interleave(num_samples)
            logits = logits.repeat_interleave(num_samples, dim=0)
        n = logits.shape[0]
        ban = torch.tensor(list(banned_ids), dtype=torch.long, device=logits.device)
        tokens = torch.full((n, max_new_tokens), _TOK.pad_id, dtype=torch.long, device=logits.device)
        logprobs = torch.zeros((n, max_new_tokens), device=logits.device)
        finished = torch.zeros(n, dtype=torch.bool, device=logits.device)
        lengths = torch.zeros(n, dtype=torch.long, device=logits.device)
        for step in range(max_new_tokens):
            if ban.numel():
                logits = logits.index_fill(-1, ban, float("-inf"))
            tok, lp = sample_next(logits, temperature, top_k, top_p, generator)
            tok = tok.masked_fill(finished, _TOK.pad_id)
            tokens[:, step] = tok
            logprobs[:, step] = lp.masked_fill(finished, 0.0)
            lengths += (~finished).long()
            if eos_id is not None:
                finished |= tok == eos_id
            if stop_fn is not None:
                for row in torch.nonzero((tok == NEWLINE) & ~finished).flatten().tolist():
                    if stop_fn(tokens[row, : step + 1].tolist()):
                        finished[row] = True
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            live = ~finished
            logits = model(tok[:, None], valid=live[:, None], cache=cache).logits[:, -1]
        return Generation(tokens=tokens, logprobs=logprobs, lengths=lengths)
    finally:
        model.train(was_training)


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
