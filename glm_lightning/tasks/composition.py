"""Arithmetic composition corpus for data-diversity and data-ordering studies (the tutorial's section-5 study).

An example composes 3 operations drawn from {add c, subtract c, multiply by c, negate, absolute value}, c in 2..5:

    prompt:     "Task: start with x. add 3. negate. multiply by 2.\\nPython: "
    completion: "((-(x + 3)) * 2)\\n"

Canonical expression format: start from `x`; every operation wraps the whole expression so far, with no spaces
inside unary forms and single spaces around binary operators:
    add c -> `(E + c)`,  sub c -> `(E - c)`,  mul c -> `(E * c)`,  neg -> `(-E)`,  abs -> `abs(E)`.
(This is the tutorial's format, e.g. `((-(-x)) + 3)`.) `CompositionTask.evaluate(x)` folds the same operations in
plain Python, so a generated expression can be checked without running it in the training process.

A *structure* is the sequence of operation types (constants and phrasing vary per example). As in the tutorial,
structures of 3 operations using at least 2 different operation types are used: 5**3 - 5 = 120. They are shuffled
deterministically and split into `n_train` (88) training structures and the rest (32) held out; `pool_size` picks
how many training structures the examples are drawn from (e.g. 8 repeated vs 88 diverse at equal step count).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

OPS: tuple[str, ...] = ("add", "sub", "mul", "neg", "abs")
BINARY_OPS: frozenset[str] = frozenset({"add", "sub", "mul"})
CONSTANTS: tuple[int, ...] = (2, 3, 4, 5)
PHRASES: dict[str, tuple[str, ...]] = {
    "add": ("add {c}.", "increase it by {c}."),
    "sub": ("subtract {c}.", "decrease it by {c}."),
    "mul": ("multiply by {c}.", "scale it by {c}."),
    "neg": ("negate.", "flip the sign."),
    "abs": ("take the absolute value.", "make it nonnegative."),
}
PROMPT_PREFIX = "Task: start with x."
PROMPT_SUFFIX = "\nPython: "
MAX_TEXT_BYTES = 128  # every example's prompt + completion (before bos/eos), checked by the tests

Structure = tuple[str, ...]


def _check_structure(structure: Sequence[str]) -> Structure:
    structure = tuple(structure)
    if not structure or any(op not in OPS for op in structure):
        raise ValueError(f"bad structure {structure!r}; operations must be from {OPS}")
    return structure


def composition_structures(length: int = 3, min_distinct: int = 2) -> list[Structure]:
    """All structures of `length` operations with at least `min_distinct` operation types, in `itertools.product`
    order over `OPS` (120 with the defaults)."""
    return [s for s in itertools.product(OPS, repeat=length) if len(set(s)) >= min_distinct]


def split_structures(
    n_train: int = 88, seed: int = 0, *, structures: Sequence[Structure] | None = None
) -> tuple[list[Structure], list[Structure]]:
    """Deterministic (train, held_out) split of the structures: a seeded shuffle, first `n_train` for training.

    Use `train[:pool_size]` (or `pool_size=` of `make_composition_examples`) for a smaller training pool; pools are
    nested, so the 8-structure pool is part of the 88-structure pool.
    """
    values = list(composition_structures() if structures is None else [_check_structure(s) for s in structures])
    if not 0 < n_train < len(values):
        raise ValueError(f"n_train must be in 1..{len(values) - 1}, got {n_train}")
    random.Random(f"composition-split/{seed}").shuffle(values)
    return values[:n_train], values[n_train:]


@dataclass(frozen=True)
class CompositionTask:
    """One composition example. `constants[i]` is None for neg/abs."""

    structure: Structure
    constants: tuple[int | None, ...]
    instructions: tuple[str, ...]
    index: int = 0

    @property
    def prompt(self) -> str:
        return f"{PROMPT_PREFIX} {' '.join(self.instructions)}{PROMPT_SUFFIX}"

    @property
    def expression(self) -> str:
        expression = "x"
        for op, c in zip(self.structure, self.constants):
            if op == "add":
                expression = f"({expression} + {c})"
            elif op == "sub":
                expression = f"({expression} - {c})"
            elif op == "mul":
                expression = f"({expression} * {c})"
            elif op == "neg":
                expression = f"(-{expression})"
            else:
                expression = f"abs({expression})"
        return expression

    @property
    def completion(self) -> str:
        return self.expression + "\n"

    @property
    def text(self) -> str:
        return self.prompt + self.completion

    @property
    def group(self) -> str:
        """The first operation type: the example's family name in the pre-training corpus (blocked ordering)."""
        return self.structure[0]

    def evaluate(self, x: int) -> int:
        """Value of the target expression at `x`, computed by folding the operations (no code execution)."""
        value = x
        for op, c in zip(self.structure, self.constants):
            if op == "add":
                value = value + c  # type: ignore[operator]
            elif op == "sub":
                value = value - c  # type: ignore[operator]
            elif op == "mul":
                value = value * c  # type: ignore[operator]
            elif op == "neg":
                value = -value
            else:
                value = abs(value)
        return value


def make_composition_task(structure: Sequence[str], index: int, seed: int = 0, *, paraphrase: bool = True) -> CompositionTask:
    """Example `index` of `structure`: constants (and, with `paraphrase`, the wording) drawn from a seeded RNG."""
    structure = _check_structure(structure)
    rng = random.Random(f"composition/{seed}/{index}/{'-'.join(structure)}")
    constants: list[int | None] = []
    instructions: list[str] = []
    for op in structure:
        c = rng.choice(CONSTANTS) if op in BINARY_OPS else None
        phrases = PHRASES[op]
        phrase = phrases[rng.randrange(len(phrases))] if paraphrase else phrases[0]
        constants.append(c)
        instructions.append(phrase.format(c=c))
    return CompositionTask(structure=structure, constants=tuple(constants), instructions=tuple(instructions), index=index)


def make_composition_examples(
    structures: Sequence[Structure],
    n: int,
    seed: int = 0,
    *,
    pool_size: int | None = None,
    paraphrase: bool = True,
    start_index: int = 0,
) -> list[CompositionTask]:
    """`n` examples, interleaved: example i (global index `start_index + i`) uses `pool[(start_index + i) % len(pool)]`
    where `pool = structures[:pool_size]`. Orderings (blocked, curriculum) are the corpus DataModule's job.

    For a held-out evaluation set use the held-out structures with a different seed, e.g.
    `make_composition_examples(held_out, len(held_out), seed + 999)`.
    """
    pool = [_check_structure(s) for s in structures]
    if pool_size is not None:
        if not 1 <= pool_size <= len(pool):
            raise ValueError(f"pool_size must be in 1..{len(pool)}, got {pool_size}")
        pool = pool[:pool_size]
    if not pool:
        raise ValueError("no structures to draw examples from")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [make_composition_task(pool[i % len(pool)], i, seed, paraphrase=paraphrase)
            for i in range(start_index, start_index + n)]
