"""Cached generation: incremental == full forward, cached greedy == naive loop, determinism, ragged prompts,
dropping finished rows changes no token."""

import pytest
import torch

from glm_lightning.generation import generate, generate_naive, sample_next, sampling_logprobs
from glm_lightning.model import GLMConfig, GLMModel
from glm_lightning.model.model import GLMOutput
from glm_lightning.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def tiny(pattern="LLLS", **kw) -> GLMModel:
    torch.manual_seed(0)
    return GLMModel(GLMConfig.preset("tiny", layer_pattern=pattern, **kw)).eval()


@pytest.mark.parametrize("pattern", ["L", "S", "LLLS"])
@pytest.mark.parametrize("split", [1, 5, 20])
def test_incremental_logits_equal_full_forward(pattern, split):
    model = tiny(pattern)
    ids = torch.randint(0, 256, (2, 30))  # 30 > index_top_k 8: decode runs in the sparse regime
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(2)
        parts = [model(ids[:, :split], cache=cache).logits]
        for t in range(split, 30):
            parts.append(model(ids[:, t:t + 1], cache=cache).logits)
    inc = torch.cat(parts, dim=1)
    assert (inc - full).abs().max() < 1e-4


def test_two_part_prefill_equals_one():
    model = tiny()
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        c1, c2 = model.new_cache(2), model.new_cache(2)
        one = model(ids, cache=c1).logits
        two = torch.cat([model(ids[:, :11], cache=c2).logits, model(ids[:, 11:], cache=c2).logits], 1)
    assert (one - two).abs().max() < 1e-4 and c1.length == c2.length == 24


def test_cached_greedy_equals_naive_loop():
    model = tiny()
    prompt = torch.tensor([TOK.encode("# Complete this Python function.\ndef f(x):", bos=True)] * 2)
    prompt[1, -3] = ord("y")
    cached = generate(model, prompt, max_new_tokens=20, eos_id=None).tokens
    naive = generate_naive(model, prompt, max_new_tokens=20, eos_id=None)
    assert torch.equal(cached, naive)


def test_same_generator_same_samples_and_num_samples_layout():
    model = tiny()
    prompt = torch.tensor([TOK.encode("def g(a):", bos=True)])
    run = lambda seed: generate(model, prompt, max_new_tokens=12, temperature=1.0, num_samples=4,
                                generator=torch.Generator().manual_seed(seed), eos_id=None)
    a, b, c = run(1), run(1), run(2)
    assert a.tokens.shape == (4, 12)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.tokens, c.tokens)
    assert (a.logprobs <= 0).all() and (a.logprobs < 0).any()


def test_ragged_rows_equal_each_row_alone():
    model = tiny()
    texts = ["def f(x):", "# a longer prompt here\ndef h(value):"]
    rows = [torch.tensor([TOK.encode(t, bos=True)]) for t in texts]
    alone = [generate(model, r, max_new_tokens=16, eos_id=None).tokens[0] for r in rows]
    left_ids, left_valid = TOK.encode_batch(texts)  # the project's convention: left padding + bool mask
    width = left_ids.shape[1]
    right_ids = torch.full((2, width), TOK.pad_id)
    right_valid = torch.zeros((2, width), dtype=torch.bool)
    for i, r in enumerate(rows):
        right_ids[i, : r.shape[1]], right_valid[i, : r.shape[1]] = r[0], True
    for ids, valid in ((left_ids, left_valid), (right_ids, right_valid)):  # any padding side, given its mask
        together = generate(model, ids, max_new_tokens=16, attention_mask=valid, eos_id=None).tokens
        for i in range(2):
            assert torch.equal(together[i], alone[i])


def batch_sizes(model) -> list[int]:
    """Record the batch size of every forward call (to see whether finished rows were dropped)."""
    seen: list[int] = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(args[0].shape[0]), with_kwargs=True)
    return seen


def test_sampling_is_torch_multinomial():
    """The per-row exponential race draws exactly what torch.multinomial drew before (same seed, same tokens)."""
    logits = torch.randn(16, 262) * 3
    logits[:, :4] = float("-inf")
    for kw in (dict(top_k=None, top_p=None), dict(top_k=30, top_p=None), dict(top_k=None, top_p=0.8)):
        tok, lp = sample_next(logits, 0.7, generator=torch.Generator().manual_seed(4), **kw)
        ref_logp = sampling_logprobs(logits, 0.7, **kw)
        ref = torch.multinomial(ref_logp.exp(), 1, generator=torch.Generator().manual_seed(4)).squeeze(-1)
        assert torch.equal(tok, ref) and torch.equal(lp, ref_logp.gather(-1, ref[:, None]).squeeze(-1))


def test_dropping_finished_rows_changes_no_token():
    """With eos made likely, rows finish at different steps; the compacted batch samples the same tokens as the
    batch that keeps every row (noise is drawn per original row), and log-probs agree to float rounding."""
    model = tiny()
    bias = torch.zeros(model.cfg.vocab_size)
    bias[TOK.eos_id] = 3.0
    model.register_forward_hook(lambda m, args, out: GLMOutput(out.logits + bias, out.aux_loss))
    seen = batch_sizes(model)
    ids, valid = TOK.encode_batch(["def f(x):", "# a longer prompt\ndef h(value):", "x"])
    run = lambda compact: generate(model, ids, max_new_tokens=24, temperature=1.0, num_samples=8,
                                   attention_mask=valid, generator=torch.Generator().manual_seed(5), compact=compact)
    kept = run(False)
    assert seen[1:] == [24] * (len(seen) - 1)  # every decode step ran the whole batch
    seen.clear()
    dropped = run(True)
    assert min(seen) < 24 and seen[1:] == sorted(seen[1:], reverse=True)  # rows really left the batch
    assert len(set(kept.lengths.tolist())) > 3 and (kept.lengths < 24).any()
    assert torch.equal(dropped.tokens, kept.tokens) and torch.equal(dropped.lengths, kept.lengths)
    assert torch.allclose(dropped.logprobs, kept.logprobs, atol=1e-5)


def test_row_left_in_a_compacted_batch_equals_row_alone():
    """Greedy: a row that outlives the others (which leave the batch) generates what it would alone."""
    model = tiny()
    seen = batch_sizes(model)
    texts = ["def f(x):", "# a longer prompt here\ndef h(value):", "return"]
    rows = [torch.tensor([TOK.encode(t, bos=True)]) for t in texts]
    free = [generate(model, r, max_new_tokens=16, eos_id=None).tokens[0] for r in rows]
    stop = int(free[0][3])  # an "eos" that row 0 emits early, so row 0 finishes before the end
    alone = [generate(model, r, max_new_tokens=16, eos_id=stop) for r in rows]
    lengths = [int(a.lengths[0]) for a in alone]
    assert lengths[0] <= 4 and max(lengths) == 16
    ids, valid = TOK.encode_batch(texts)
    seen.clear()
    together = generate(model, ids, max_new_tokens=16, attention_mask=valid, eos_id=stop)
    assert min(seen) < 3
    for i in range(3):
        assert torch.equal(together.tokens[i], alone[i].tokens[0]) and int(together.lengths[i]) == lengths[i]


def test_padding_mix_ups_are_refused():
    """Lengths (or a 0/1 int mask) cannot be passed where the bool validity mask is meant: with left-padded rows,
    lengths read as "the first L tokens are real" would silently generate from pad positions."""
    model = tiny()
    ids, valid = TOK.encode_batch(["a", "abc"])
    lengths = valid.sum(1)
    for wrong in (lengths, valid.long(), valid[:, 1:]):
        with pytest.raises(TypeError, match="bool tensor"):
            generate(model, ids, max_new_tokens=2, attention_mask=wrong)
    with pytest.raises(TypeError):
        generate(model, ids, max_new_tokens=2, prompt_lengths=lengths)  # the ambiguous argument is gone


def force_token(model, token_id):
    """Make `token_id` the argmax everywhere: constant final hidden state, head row aligned with it."""
    model.final_norm.register_forward_hook(lambda m, inp, out: torch.ones_like(out))
    model.untie_head()
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[token_id] = 1.0


def test_eos_stops_rows_and_pads_after():
    model = tiny()
    force_token(model, TOK.eos_id)
    out = generate(model, torch.tensor([TOK.encode("x", bos=True)] * 3), max_new_tokens=10)
    assert (out.tokens[:, 0] == TOK.eos_id).all() and (out.lengths == 1).all()
    assert out.tokens.shape[1] == 10 and (out.tokens[:, 1:] == TOK.pad_id).all()


def test_stop_fn_is_consulted_after_newlines():
    model = tiny()
    force_token(model, ord("\n"))
    calls = []
    out = generate(model, torch.tensor([TOK.encode("x", bos=True)]), max_new_tokens=10, eos_id=None,
                   stop_fn=lambda toks: calls.append(list(toks)) or len(toks) >= 3)
    assert out.lengths.tolist() == [3] and calls[-1] == [10, 10, 10]


@pytest.mark.parametrize("kw, msg", [
    (dict(max_new_tokens=100), "exceeds the model context"),
    (dict(num_samples=0), "num_samples"),
    (dict(temperature=-1.0), "temperature"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_bad_generation_arguments(kw, msg):
    model = tiny()
    with pytest.raises(ValueError, match=msg):
        generate(model, torch.tensor([[TOK.bos_id, 65]]), **kw)


def test_out_of_range_prompt_ids():
    with pytest.raises(ValueError, match="token ids"):
        generate(tiny(), torch.tensor([[TOK.bos_id, 9999]]))


def test_decode_loop_runs_without_gc_pauses_and_restores_the_collector():
    import gc

    model = tiny()
    seen = []

    def stop_fn(tokens):
        seen.append(gc.isenabled())
        return False

    prompt = torch.tensor([TOK.encode("def f(x):\n", bos=True)])
    assert gc.isenabled()
    force_token(model, ord("\n"))
    generate(model, prompt, max_new_tokens=3, stop_fn=stop_fn)
    assert seen and not any(seen) and gc.isenabled()  # off inside the loop, back on after
    gc.disable()
    try:
        generate(model, prompt, max_new_tokens=2, stop_fn=stop_fn)
        assert not gc.isenabled()  # a caller's own setting is left as it was
    finally:
        gc.enable()
