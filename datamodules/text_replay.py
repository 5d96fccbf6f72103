"""Text replay for vision fine-tuning: attach pre-training text batches to a share of the digit batches.

A model fine-tuned only on images forgets the code it learnt to write; rehearsing a little of the pre-training data
keeps that skill in use. `ReplayBatches` wraps the digit loader and, on a fixed fraction `ratio` of its batches,
adds ``batch["text"]`` (a CodeCorpusDataModule batch: ``input_ids``, ``targets``, ``completion_mask``), which the
VisionModule scores with the next-token loss. The schedule is deterministic: batch i (counted over the whole run)
carries text when ``floor((i + 1) * ratio) > floor(i * ratio)``, so ratio 0.5 means every second batch and 1 every
batch. The text stream restarts from its beginning when it runs out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

REPLAY_DEFAULTS = {"ratio": 0.5}


def replay_due(i: int, ratio: float) -> bool:
    """Whether batch `i` (0-based, counted over the run) carries a text batch."""
    return math.floor((i + 1) * ratio) > math.floor(i * ratio)


class ReplayBatches:
    """The digit loader's batches, a share `ratio` of them with a text batch attached (see the module docstring)."""

    def __init__(self, digits: Iterable[dict[str, Any]], text: Iterable[dict[str, Any]], ratio: float) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"text_replay.ratio must lie in (0, 1] (text batches per digit batch), got {ratio}")
        self.digits, self.text, self.ratio = digits, text, ratio
        self.served = 0  # over the whole run, so the schedule does not restart every epoch
        self._text_iter: Iterator[dict[str, Any]] | None = None

    def __len__(self) -> int:
        return len(self.digits)  # type: ignore[arg-type]

    def _next_text(self) -> dict[str, Any]:
        for _ in range(2):
            if self._text_iter is None:
                self._text_iter = iter(self.text)
            batch = next(self._text_iter, None)
            if batch is not None:
                return batch
            self._text_iter = None
        raise ValueError("the text replay loader yields no batches (num_examples too small?)")

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.digits:
            if replay_due(self.served, self.ratio):
                batch = {**batch, "text": self._next_text()}
            self.served += 1
            yield batch
