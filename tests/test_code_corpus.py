"""CodeCorpusDataModule: the yielded order is exactly the named one, DDP shards keep it, bad config fails early."""

import itertools

import pytest
import torch

from datamodules.code_corpus import IGNORE, CodeCorpusDataModule, OrderedRows
from glm_lightning.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
FAMS = ["increment", "double", "reverse", "even"]


def groups(dm):
    return [e.group for e in dm.training_examples()]


def runs(seq):
    return [k for k, _ in itertools.groupby(seq)]


def test_blocked_is_contiguous_runs_in_given_order():
    dm = CodeCorpusDataModule(families=FAMS, ordering="blocked", num_examples=40)
    g = groups(dm)
    assert runs(g) == FAMS and [g.count(f) for f in FAMS] == [10] * 4


def test_interleaved_is_balanced_mix():
    dm = CodeCorpusDataModule(families=FAMS, ordering="interleaved", num_examples=40)
    g = groups(dm)
    assert len(runs(g)) > 20  # many switches between families
    for i in range(0, 40, 4):  # each round of 4 visits every family once
        assert sorted(g[i:i + 4]) == sorted(FAMS)


def test_curriculum_follows_stages():
    stages = [{"groups": ["increment", "double"], "fraction": 0.25}, {"fraction": 0.75}]
    dm = CodeCorpusDataModule(families=FAMS, ordering="curriculum", curriculum=stages, num_examples=40)
    g = groups(dm)
    assert set(g[:10]) == {"increment", "double"}
    assert set(g[10:]) == set(FAMS)


def test_diversity_pool_limits_identities():
    small = CodeCorpusDataModule(families=FAMS, diversity=4, num_examples=64)
    large = CodeCorpusDataModule(families=FAMS, diversity=None, num_examples=64)
    names = lambda dm: {e.prompt.split("def ")[1].split("(")[0] for e in dm.training_examples()}
    assert len(names(small)) == 4 and len(names(large)) == 64


def test_composition_corpus_holds_out_structures():
    dm = CodeCorpusDataModule(corpus="composition", num_examples=64, batch_size=4, val_examples=32)
    dm.setup("fit")
    train_prompts = {e.prompt for e in dm.training_examples()}
    assert len(dm.val_rows) == 32 and dm.dev_tasks == []
    # held-out structures: a validation prompt never appears in training
    val_texts = {TOK.decode(ids).split("\n")[0] for ids, _ in dm.val_rows}
    assert not ({p.split("\n")[0] for p in train_prompts} & val_texts)


def test_deterministic_by_seed():
    a = CodeCorpusDataModule(families=FAMS, num_examples=20, seed=3).training_examples()
    b = CodeCorpusDataModule(families=FAMS, num_examples=20, seed=3).training_examples()
    c = CodeCorpusDataModule(families=FAMS, num_examples=20, seed=4).training_examples()
    assert a == b and a != c


def test_batches_targets_and_masks():
    dm = CodeCorpusDataModule(families=FAMS, num_examples=8, batch_size=2, packing=False)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    ids, tgt, cm = batch["input_ids"], batch["targets"], batch["completion_mask"]
    assert ids.shape == tgt.shape == cm.shape == (2, 192)
    assert torch.equal(tgt[:, :-1][tgt[:, :-1] != IGNORE], ids[:, 1:][tgt[:, :-1] != IGNORE])
    text = TOK.decode(tgt[0][cm[0]].clamp(min=0))
    assert text.startswith("\n    return")  # the completion mask covers exactly the completion bytes (+eos)


def test_packing_puts_several_examples_per_row():
    dm = CodeCorpusDataModule(corpus="composition", num_examples=40, packing=True)
    dm.setup("fit")
    per_row = [sum(1 for t in ids if t == TOK.bos_id) for ids, _ in dm.train_rows]
    assert max(per_row) >= 2 and sum(per_row) == 40


def test_ddp_shards_preserve_order():
    dm = CodeCorpusDataModule(families=FAMS, ordering="blocked", num_examples=40, packing=False)
    dm.setup("fit")
    rank0, rank1 = OrderedRows(dm.train_rows, 0, 2), OrderedRows(dm.train_rows, 1, 2)
    merged = [r for pair in zip(rank0, rank1) for r in pair]
    assert merged == dm.train_rows[: len(merged)]
    first_ids = lambda rows: [TOK.decode(r[0]).split("def ")[1][:3] for r in rows]
    assert runs([s for s in first_ids(list(rank0))]) == ["inc", "dou", "rev", "eve"]


@pytest.mark.parametrize("kw, msg", [
    (dict(families=["nope"]), "unknown task family"),
    (dict(families=[]), "empty"),
    (dict(ordering="random"), "unknown ordering"),
    (dict(corpus="books"), "unknown corpus"),
    (dict(ordering="curriculum", curriculum=[{"fraction": 0.5}]), "sum to"),
    (dict(ordering="curriculum"), "needs `curriculum`"),
    (dict(seq_len=32), "too short"),
])
def test_bad_config_raises_at_construction(kw, msg):
    with pytest.raises(ValueError, match=msg):
        CodeCorpusDataModule(**kw)
