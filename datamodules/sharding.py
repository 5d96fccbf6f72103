"""Which shard of the data this process serves: (global rank, world size) from the attached Trainer, (0, 1) alone."""

from __future__ import annotations

from typing import Any


def rank_and_world(datamodule: Any) -> tuple[int, int]:
    trainer = getattr(datamodule, "trainer", None)
    if trainer is None:
        return 0, 1
    return trainer.global_rank, trainer.world_size
