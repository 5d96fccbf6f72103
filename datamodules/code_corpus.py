"""CodeCorpusDataModule: the pre-training data, with the knobs that data-ordering studies change.

- `corpus`: `functions` (small Python functions from the task registry) or `composition` (arithmetic composition
  programs; held-out *structures* for validation).
- `ordering`: `interleaved` (balanced shuffled mix of all groups), `blocked` (one contiguous run per group, in the
  given order), `curriculum` (stages from YAML, each a mix of its own groups, run in stage order).
- `diversity`: size of the pool of distinct identities (functions) or structures (composition) examples are drawn
  from; `None` = fresh data for every example. Equal step counts then compare repeated vs diverse data.
- `packing`: several `<bos>prompt completion<eos>` examples per row (examples never split), or one per row.

The training order is materialised once, deterministically from `seed`, then served by an IterableDataset that gives
rank r of W the rows r, r+W, r+2W, ... in order, so the named order survives DDP (no DistributedSampler reshuffle).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from glm_lightning.evaluation import rank_and_world
from glm_lightning.tasks import composition
from glm_lightning.tasks.families import CLASSIC_FAMILIES, HELD_OUT_FAMILIES, resolve_families
from glm_lightning.tasks.task import Task, iter_train_tasks, make_tasks
from glm_lightning.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
IGNORE = -100
ORDERINGS = ("interleaved", "blocked", "curriculum")
CORPORA = ("functions", "composition")


@dataclass(frozen=True)
class Example:
    group: str
    prompt: str
    completion: str

    def ids(self) -> tuple[list[int], int]:
        """Token ids `<bos> prompt completion <eos>` and the index where the completion starts."""
        prompt = TOK.encode(self.prompt, bos=True)
        return prompt + TOK.encode(self.completion, eos=True), len(prompt)


# --- corpus adaptors: a stream of examples for a set of groups ------------------------------------------------------
def function_stream(groups: Sequence[str], pool_size: int | None, seed: int) -> Iterator[Example]:
    for task in iter_train_tasks(list(groups), seed, pool_size=pool_size):
        yield Example(task.family, task.prompt, task.completion)


def composition_groups() -> tuple[str, ...]:
    """Composition examples are grouped by their first operation (blocked/curriculum units)."""
    return composition.OPS


def composition_stream(groups: Sequence[str], pool_size: int | None, seed: int, n_train: int) -> Iterator[Example]:
    """Endless examples from the training structures whose first operation is in `groups` (structure split fixed
    across data seeds, so held-out structures are the same for every seed of a study)."""
    train, _ = composition.split_structures(n_train, seed=0)
    structures = [s for s in train if s[0] in groups]
    if pool_size is not None:
        structures = structures[: max(1, pool_size)]
    chunk = 4 * len(structures)
    for k in itertools.count():
        for ex in composition.make_composition_examples(structures, chunk, seed, start_index=k * chunk):
            yield Example(ex.group, ex.prompt, ex.completion)


def composition_heldout(n: int, seed: int, n_train: int) -> list[Example]:
    _, held_out = composition.split_structures(n_train, seed=0)
    return [Example(e.group, e.prompt, e.completion)
            for e in composition.make_composition_examples(held_out, n, seed + 999)]


# --- datasets --------------------------------------------------------------------------------------------------------
def pack_rows(examples: Sequence[Example], seq_len: int, packing: bool) -> list[tuple[list[int], list[bool]]]:
    """Rows of seq_len + 1 ids (inputs = row[:-1], targets = row[1:]) with a completion-target mask, in order."""
    rows: list[tuple[list[int], list[bool]]] = []
    cur_ids: list[int] = []
    cur_mask: list[bool] = []
    width = seq_len + 1
    for ex in examples:
        ids, start = ex.ids()
        if len(ids) > width:
            raise ValueError(f"seq_len {seq_len} is too short for an example of {len(ids)} tokens "
                             f"({ex.prompt[:40]!r}...); raise data.seq_len to at least {len(ids) - 1}")
        mask = [False] * start + [True] * (len(ids) - start)
        if cur_ids and (not packing or len(cur_ids) + len(ids) > width):
            rows.append((cur_ids, cur_mask))
            cur_ids, cur_mask = [], []
        cur_ids += ids
        cur_mask += mask
    if cur_ids:
        rows.append((cur_ids, cur_mask))
    return rows


def collate_rows(rows: Sequence[tuple[list[int], list[bool]]], seq_len: int) -> dict[str, torch.Tensor]:
    width = seq_len + 1
    ids = torch.full((len(rows), width), TOK.pad_id, dtype=torch.long)
    cmask = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, (r, m) in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
        cmask[b, : len(m)] = torch.tensor(m)
    targets = ids[:, 1:].clone()
    targets[(targets == TOK.pad_id) | (targets == TOK.bos_id)] = IGNORE
    return {"input_ids": ids[:, :-1], "targets": targets, "completion_mask": cmask[:, 1:] & (targets != IGNORE)}


class OrderedRows(IterableDataset):
    """The materialised training order; rank r of W yields rows r, r+W, ... (order preserved within a rank)."""

    def __init__(self, rows: list[tuple[list[int], list[bool]]], rank: int = 0, world_size: int = 1) -> None:
        self.rows = rows[rank::world_size]

    def __iter__(self) -> Iterator[tuple[list[int], list[bool]]]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


class ResumableLoader(DataLoader):
    """A DataLoader that remembers how many batches of the current pass it served, so that a run resumed with
    `--ckpt_path` continues the data stream where it stopped instead of replaying the start of the epoch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._served = 0
        self._skip = 0

    def __iter__(self) -> Iterator[Any]:
        it = super().__iter__()
        self._served = 0
        for _ in range(self._skip):
            if next(it, None) is None:
                break
            self._served += 1
        self._skip = 0
        for batch in it:
            self._served += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"batches_served": self._served}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = int(state.get("batches_served", 0))


class RowList(Dataset):
    def __init__(self, rows: list[tuple[list[int], list[bool]]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[list[int], list[bool]]:
        return self.rows[i]


class CodeCorpusDataModule(pl.LightningDataModule):
    """Pre-training corpora with interleaved / blocked / curriculum ordering and a diversity knob."""

    def __init__(
        self,
        corpus: str = "functions",
        families: list[str] | None = None,
        ordering: str = "interleaved",
        curriculum: list[dict[str, Any]] | None = None,
        diversity: int | None = None,
        num_examples: int = 4096,
        packing: bool = True,
        seq_len: int = 192,
        batch_size: int = 16,
        seed: int = 0,
        val_per_family: int = 4,
        dev_per_family: int = 2,
        heldout_per_family: int = 0,
        composition_train_structures: int = 88,
        val_examples: int = 256,
    ) -> None:
        """
        Args:
            corpus: `functions` or `composition`.
            families: groups to train on: task families (default: the 8 classic ones) or composition groups
                (default: all).
            ordering: `interleaved`, `blocked` or `curriculum`.
            curriculum: stages for `ordering: curriculum`, e.g. `[{groups: [increment, double], fraction: 0.5,
                diversity: 8}, {fraction: 0.5}]`; a stage without `groups` uses all `families`; fractions sum to 1.
            diversity: pool size of distinct identities/structures to draw from (None = always fresh).
            num_examples: training examples in one epoch of the stream.
            packing: several examples per row (eos-separated) instead of one per row.
            seq_len: tokens per row.
            batch_size: rows per batch.
            seed: fixes the data order and identities.
            val_per_family: held-out identities per family for val loss/accuracy (functions corpus).
            dev_per_family: held-out tasks per family generated greedily and verified (`val/dev_pass`).
            heldout_per_family: tasks per never-trained family (decrement, triple, square_plus_one, max_of_list, less
                any listed in `families`), generated greedily and verified at each validation (`val/heldout_pass`):
                generalisation to families the corpus never shows (functions corpus; 0 = off).
            composition_train_structures: how many of the composition structures are for training (rest held out).
            val_examples: held-out-structure examples for validation (composition corpus).
        """
        super().__init__()
        if corpus not in CORPORA:
            raise ValueError(f"unknown corpus {corpus!r}; choose one of {CORPORA}")
        if ordering not in ORDERINGS:
            raise ValueError(f"unknown ordering {ordering!r}; choose one of {ORDERINGS}")
        if families is not None and len(families) == 0:
            raise ValueError("families is empty; list at least one family/group (or leave it unset)")
        if num_examples < 1 or batch_size < 1 or seq_len < 8:
            raise ValueError("num_examples and batch_size must be >= 1 and seq_len >= 8")
        if diversity is not None and diversity < 1:
            raise ValueError("diversity (pool size) must be >= 1 or null")
        if dev_per_family < 0 or heldout_per_family < 0:
            raise ValueError("dev_per_family and heldout_per_family must be >= 0")
        if heldout_per_family and corpus != "functions":
            raise ValueError("heldout_per_family needs corpus: functions (the held-out families are task families)")
        self.save_hyperparameters()
        self.groups = self._resolve_groups(families)
        self.stages = self._resolve_stages(curriculum)
        self._check_seq_len()
        self.train_rows: list[tuple[list[int], list[bool]]] = []
        self.val_rows: list[tuple[list[int], list[bool]]] = []
        self.dev_tasks: list[Task] = []
        self.heldout_tasks: list[Task] = []

    @property
    def heldout_families(self) -> tuple[str, ...]:
        """The never-trained families `val/heldout_pass` asks about (those not in the training groups)."""
        if self.hparams.corpus != "functions":
            return ()
        return tuple(f for f in HELD_OUT_FAMILIES if f not in self.groups)

    # --- configuration checks -----------------------------------------------------------------------------------
    def _resolve_groups(self, families: list[str] | None) -> tuple[str, ...]:
        if self.hparams.corpus == "functions":
            return resolve_families(families if families is not None else list(CLASSIC_FAMILIES))
        known = composition_groups()
        chosen = tuple(families) if families is not None else tuple(known)
        unknown = [g for g in chosen if g not in known]
        if unknown:
            raise ValueError(f"unknown composition group(s) {unknown}; valid groups: {list(known)}")
        return chosen

    def _resolve_stages(self, curriculum: list[dict[str, Any]] | None) -> list[tuple[tuple[str, ...], float, int | None]]:
        hp = self.hparams
        if hp.ordering != "curriculum":
            if curriculum:
                raise ValueError(f"curriculum stages were given but ordering is {hp.ordering!r}")
            return []
        if not curriculum:
            raise ValueError("ordering 'curriculum' needs `curriculum` stages")
        stages = []
        for i, st in enumerate(curriculum):
            extra = set(st) - {"groups", "families", "fraction", "diversity"}
            if extra:
                raise ValueError(f"curriculum stage {i}: unknown key(s) {sorted(extra)}")
            groups = st.get("groups", st.get("families"))
            groups = self.groups if groups is None else self._resolve_groups(list(groups))
            fraction = float(st.get("fraction", 0))
            if fraction <= 0:
                raise ValueError(f"curriculum stage {i}: fraction must be > 0")
            stages.append((groups, fraction, st.get("diversity", hp.diversity)))
        total = sum(f for _, f, _ in stages)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"curriculum stage fractions sum to {total:g}, not 1: the stages must cover the run")
        return stages

    def _check_seq_len(self) -> None:
        longest = max(len(ex.ids()[0]) for ex in itertools.islice(self._stream(self.groups, None, 1), 200))
        if longest > self.hparams.seq_len + 1:
            raise ValueError(f"seq_len {self.hparams.seq_len} is too short for one example (up to {longest} tokens "
                             f"seen); raise data.seq_len to at least {longest - 1}")

    # --- building the order -------------------------------------------------------------------------------------
    def _stream(self, groups: Sequence[str], pool: int | None, seed: int) -> Iterator[Example]:
        if self.hparams.corpus == "functions":
            return function_stream(groups, pool, seed)
        return composition_stream(groups, pool, seed, self.hparams.composition_train_structures)

    def training_examples(self) -> list[Example]:
        """The exact training order (deterministic in `seed`)."""
        hp = self.hparams
        n = hp.num_examples
        if hp.ordering == "interleaved":
            return list(itertools.islice(self._stream(self.groups, hp.diversity, hp.seed), n))
        if hp.ordering == "blocked":
            out: list[Example] = []
            sizes = [n // len(self.groups) + (i < n % len(self.groups)) for i in range(len(self.groups))]
            pool = None if hp.diversity is None else max(1, hp.diversity // len(self.groups))
            for i, (group, size) in enumerate(zip(self.groups, sizes)):
                out += itertools.islice(self._stream([group], pool, hp.seed + 1000 * i), size)
            return out
        out = []
        bounds = [round(n * f) for f in itertools.accumulate(f for _, f, _ in self.stages)]
        start = 0
        for i, ((groups, _, pool), end) in enumerate(zip(self.stages, bounds)):
            out += itertools.islice(self._stream(groups, pool, hp.seed + 1000 * i), end - start)
            start = end
        return out

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        if not self.train_rows:
            self.train_rows = pack_rows(self.training_examples(), hp.seq_len, hp.packing)
        if not self.val_rows:
            if hp.corpus == "functions":
                val = [Example(t.family, t.prompt, t.completion)
                       for t in make_tasks("dev", hp.val_per_family, self.groups, seed=hp.seed + 1)]
                self.dev_tasks = make_tasks("dev", hp.dev_per_family, self.groups, seed=hp.seed)
                if hp.heldout_per_family and self.heldout_families:
                    self.heldout_tasks = make_tasks("dev", hp.heldout_per_family, self.heldout_families,
                                                    seed=hp.seed)
            else:
                val = composition_heldout(hp.val_examples, hp.seed, hp.composition_train_structures)
            self.val_rows = pack_rows(val, hp.seq_len, packing=False)

    def train_dataloader(self) -> DataLoader:
        rank, world = rank_and_world(self)
        ds = OrderedRows(self.train_rows, rank, world)
        return ResumableLoader(ds, batch_size=self.hparams.batch_size,
                          collate_fn=lambda rows: collate_rows(rows, self.hparams.seq_len))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(RowList(self.val_rows), batch_size=self.hparams.batch_size, shuffle=False,
                          collate_fn=lambda rows: collate_rows(rows, self.hparams.seq_len))
