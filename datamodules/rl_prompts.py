"""RLPromptDataModule: prompts for RL post-training, served from the task registry.

- `train_families` are rewarded: their `rl`-split tasks are the training prompts (`prompts_per_family` each).
- `monitor_families` are only evaluated, to detect interference (regressions on families RL does not train).
- Evaluation uses `eval_split` (`dev` during training; `confirm` for the final confirmation) with `eval_per_family`
  tasks of every train and monitor family. Callbacks (pass@k, regression) read `eval_tasks()`.

A batch is a list of plain task records (dicts of str/int, see `task_record`), not Task objects: Lightning's
device transfer cannot rebuild frozen dataclasses (`glm_lightning.tasks.task.task_record` / `record_task`).

Training prompts come from an IterableDataset: a training epoch makes `epochs` passes over the prompt set, each
reshuffled from (seed, epoch, pass), and rank r of W takes prompts r, r+W, ... of that sequence (the ragged tail is
dropped so every rank runs the same number of steps). A prompt's whole group of G samples is generated on the rank
that owns the prompt; no DistributedSampler is inserted for an IterableDataset.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, IterableDataset

from glm_lightning.evaluation import rank_and_world
from glm_lightning.tasks.families import CLASSIC_FAMILIES, RL_FAMILIES, resolve_families
from glm_lightning.tasks.task import SPLITS, Task, make_tasks, task_record

def collate_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return list(records)


class PromptStream(IterableDataset):
    """`epochs` reshuffled passes over `records`; rank r of W yields items r, r+W, ... of each pass."""

    def __init__(self, records: Sequence[dict[str, Any]], epochs: int, seed: int, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1) -> None:
        self.records = list(records)
        self.epochs, self.seed, self.shuffle = epochs, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch = 0  # passes made so far: every new iteration (training epoch) gets a fresh order

    def order(self, epoch: int = 0) -> list[dict[str, Any]]:
        """The full (all-rank) sequence of prompts of training epoch `epoch`."""
        out: list[dict[str, Any]] = []
        for p in range(self.epochs):
            items = list(self.records)
            if self.shuffle:
                random.Random(f"rl-prompts/{self.seed}/{epoch}/{p}").shuffle(items)
            out += items
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        items = self.order(self.epoch)
        self.epoch += 1
        # equal count per rank (drop the ragged tail) so every rank runs the same number of steps under DDP
        usable = len(items) - len(items) % self.world_size
        return iter(items[self.rank:usable:self.world_size])

    def __len__(self) -> int:
        return (len(self.records) * self.epochs) // self.world_size


class RLPromptDataModule(pl.LightningDataModule):
    """Rewarded prompts (rl split) for training and evaluation tasks (dev/confirm) for monitoring."""

    def __init__(
        self,
        train_families: list[str] | str = list(RL_FAMILIES),
        monitor_families: list[str] | str | None = None,
        prompts_per_family: int = 32,
        eval_per_family: int = 8,
        eval_split: str = "dev",
        batch_size: int = 4,
        epochs: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        """
        Args:
            train_families: rewarded families (comma-separated string or list); registry names only.
            monitor_families: evaluated but never rewarded; default = the classic families not in train_families.
                An empty list means "no monitors".
            prompts_per_family: rl-split tasks per rewarded family (the training prompt set).
            eval_per_family: tasks per family (train + monitor) of `eval_split` used by validation and callbacks.
            eval_split: `dev` while training; `confirm` for a final confirmation run (`validate`).
            batch_size: prompts per optimizer step (each is sampled G times by the RL module).
            epochs: passes over the prompt set per training epoch (each pass reshuffled).
            seed: task identities and prompt order.
            shuffle: reshuffle prompts every pass (else family-major registry order).
        """
        super().__init__()
        train = resolve_families(train_families)
        if monitor_families is None:
            monitor = tuple(f for f in CLASSIC_FAMILIES if f not in train)
        elif isinstance(monitor_families, str) and not monitor_families.strip():
            monitor = ()
        elif len(monitor_families) == 0:
            monitor = ()
        else:
            monitor = resolve_families(monitor_families)
        overlap = sorted(set(train) & set(monitor))
        if overlap:
            raise ValueError(f"families {overlap} are both rewarded and monitored; a monitor family must not be "
                             "trained on")
        if eval_split not in SPLITS or eval_split in ("train", "rl"):
            raise ValueError(f"eval_split must be 'dev' or 'confirm' (tasks never trained on), got {eval_split!r}")
        if prompts_per_family < 1 or eval_per_family < 0 or batch_size < 1 or epochs < 1:
            raise ValueError("need prompts_per_family >= 1, eval_per_family >= 0, batch_size >= 1, epochs >= 1")
        self.save_hyperparameters()
        self.train_families: tuple[str, ...] = train
        self.monitor_families: tuple[str, ...] = monitor
        self.prompt_tasks: list[Task] = make_tasks("rl", prompts_per_family, train, seed=seed)
        self._stream: PromptStream | None = None

    @property
    def families(self) -> tuple[str, ...]:
        """Every evaluated family: rewarded first, then monitors."""
        return self.train_families + self.monitor_families

    def eval_tasks(self, split: str | None = None, per_family: int | None = None,
                   families: Sequence[str] | None = None) -> list[Task]:
        """Evaluation tasks (default: `eval_split`, `eval_per_family`, train + monitor families)."""
        hp = self.hparams
        return make_tasks(split or hp.eval_split, hp.eval_per_family if per_family is None else per_family,
                          list(families or self.families), seed=hp.seed)

    def train_dataloader(self) -> DataLoader:
        rank, world = rank_and_world(self)
        hp = self.hparams
        self._stream = PromptStream([task_record(t) for t in self.prompt_tasks], hp.epochs, hp.seed, hp.shuffle,
                                    rank, world)
        trainer = getattr(self, "trainer", None)
        self._stream.epoch = trainer.current_epoch if trainer is not None else 0  # reloads continue the sequence
        return DataLoader(self._stream, batch_size=hp.batch_size, collate_fn=collate_records)

    def val_dataloader(self) -> DataLoader:
        """Evaluation tasks as records (the RL module scores the reference NLL; callbacks generate)."""
        rank, world = rank_and_world(self)
        records = [task_record(t) for t in self.eval_tasks()][rank::world]
        return DataLoader(records, batch_size=max(self.hparams.batch_size, 8), shuffle=False,
                          collate_fn=collate_records)
