"""Tasks (one identity drawn from a function family), the four disjoint splits, and training streams/pools.

Identity = function name + description paraphrase + choice of argument names (+ which reference body is shown).
Everything is drawn from `random.Random(f"{split}/{family}/{seed}/{index}")`: string seeds are hashed by `random`
itself (SHA-512), so results do not depend on `PYTHONHASHSEED`, and task `index` of a split does not depend on how
many tasks are requested (`make_tasks(s, 3)` is a per-family prefix of `make_tasks(s, 8)`).

Disjoint splits: every possible function name belongs to exactly one split, `SPLITS[sha256(name) % 4]`. A split's
draw rejects names until it gets one of its own, so train/dev/rl/confirm can never share a function name, whatever
the seeds or sizes.
"""

from __future__ import annotations

import hashlib
import random
import string
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from glm_lightning.tasks.families import Family, get_family, resolve_families

SPLITS: tuple[str, ...] = ("train", "dev", "rl", "confirm")
NAME_SUFFIX_LENGTH = 7
PROMPT_HEADER = "# Complete this Python function."
# Length budget (UTF-8 bytes = byte-tokenizer tokens, before bos/eos) that every identity of every family respects,
# checked by tests/test_tasks.py: prompt + 48 new tokens and a full training text both fit a 192-token context.
MAX_PROMPT_BYTES = 128
MAX_TEXT_BYTES = 176


def split_of_name(name: str) -> str:
    """The one split that owns function name `name` (a pure function of the name)."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return SPLITS[int.from_bytes(digest[:8], "big") % len(SPLITS)]


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    return split


def indent_body(body: str) -> str:
    """Completion text for an unindented body: newline, each line indented 4 spaces, trailing newline."""
    return "\n" + "\n".join("    " + line if line else line for line in body.split("\n")) + "\n"


@dataclass(frozen=True)
class Task:
    """One function-writing task. Hashable; the hidden tests come from the family."""

    family: str
    name: str
    description: str
    args: tuple[str, ...]
    body: str
    split: str = "custom"
    index: int = 0
    description_index: int = 0
    arg_index: int = 0
    body_index: int = 0

    @property
    def family_spec(self) -> Family:
        return get_family(self.family)

    @property
    def entry_point(self) -> str:
        return self.name

    @property
    def task_id(self) -> str:
        return f"{self.split}/{self.family}/{self.index}"

    @property
    def prompt(self) -> str:
        return f"{PROMPT_HEADER}\n# {self.description}\ndef {self.name}({', '.join(self.args)}):"

    @property
    def completion(self) -> str:
        """The reference completion: `"\\n    return ...\\n"`."""
        return indent_body(self.body)

    @property
    def text(self) -> str:
        """Training text for this example (the DataModule adds bos/eos)."""
        return self.prompt + self.completion

    @property
    def tests(self) -> tuple[tuple[tuple[Any, ...], Any], ...]:
        return self.family_spec.tests

    @property
    def difficulty(self) -> int:
        return self.family_spec.difficulty

    @property
    def kind(self) -> str:
        return self.family_spec.kind

    def source(self, completion: str | None = None) -> str:
        """Full program text: prompt + `completion` (the reference completion when None)."""
        return self.prompt + (self.completion if completion is None else completion)

    def with_body(self, body_index: int) -> Task:
        """The same identity showing reference body `body_index` of its family."""
        family = self.family_spec
        return replace(self, body=family.render_body(body_index, self.arg_index), body_index=body_index)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record (tests as `[[args...], expected]`)."""
        return {
            "task_id": self.task_id,
            "split": self.split,
            "family": self.family,
            "name": self.name,
            "entry_point": self.entry_point,
            "description": self.description,
            "args": list(self.args),
            "prompt": self.prompt,
            "completion": self.completion,
            "tests": [[list(args), expected] for args, expected in self.tests],
            "difficulty": self.difficulty,
            "kind": self.kind,
        }


def build_task(
    family: str,
    name: str,
    *,
    description_index: int = 0,
    arg_index: int = 0,
    body_index: int = 0,
    split: str = "custom",
    index: int = 0,
) -> Task:
    """A task with an explicit identity (no randomness, no split check on the name)."""
    spec = get_family(family)
    return Task(
        family=family,
        name=name,
        description=spec.render_description(description_index, arg_index),
        args=spec.arg_names[arg_index],
        body=spec.render_body(body_index, arg_index),
        split=split,
        index=index,
        description_index=description_index,
        arg_index=arg_index,
        body_index=body_index,
    )


RECORD_KEYS = ("family", "name", "split", "index", "description_index", "arg_index", "body_index")


def task_record(task: Task) -> dict[str, Any]:
    """Plain-dict identity of a task: survives collation and device transfer, which cannot rebuild a frozen
    dataclass (RL batches are lists of records)."""
    return {key: getattr(task, key) for key in RECORD_KEYS}


def record_task(record: dict[str, Any]) -> Task:
    """The exact Task a `task_record` came from."""
    return build_task(record["family"], record["name"], description_index=int(record["description_index"]),
                      arg_index=int(record["arg_index"]), body_index=int(record["body_index"]),
                      split=record["split"], index=int(record["index"]))


def make_task(split: str, family: str, index: int, seed: int = 0, *, exclude: frozenset[str] | set[str] = frozenset()) -> Task:
    """Task `index` of `family` in `split`: deterministic in (split, family, seed, index), name owned by `split`.

    Names in `exclude` are rejected too (used to keep names unique within one call of `make_tasks`).
    """
    _check_split(split)
    spec = get_family(family)
    rng = random.Random(f"{split}/{family}/{seed}/{index}")
    while True:
        name = f"{family}_" + "".join(rng.choice(string.ascii_lowercase) for _ in range(NAME_SUFFIX_LENGTH))
        if split_of_name(name) == split and name not in exclude:
            break
    return build_task(
        family,
        name,
        description_index=rng.randrange(len(spec.descriptions)),
        arg_index=rng.randrange(len(spec.arg_names)),
        body_index=rng.randrange(len(spec.bodies)),
        split=split,
        index=index,
    )


def _family_tasks(split: str, family: str, count: int, seed: int) -> list[Task]:
    taken: set[str] = set()
    tasks = []
    for index in range(count):
        task = make_task(split, family, index, seed, exclude=taken)
        taken.add(task.name)
        tasks.append(task)
    return tasks


def make_tasks(split: str, per_family: int, families: Sequence[str] | str | None = None, seed: int = 0) -> list[Task]:
    """`per_family` tasks for each family (family-major order); names unique within a family and owned by `split`."""
    _check_split(split)
    if per_family < 0:
        raise ValueError(f"per_family must be >= 0, got {per_family}")
    tasks: list[Task] = []
    for family in resolve_families(families):
        tasks.extend(_family_tasks(split, family, per_family, seed))
    return tasks


def make_pool(split: str, families: Sequence[str] | str | None, pool_size: int, seed: int = 0) -> list[Task]:
    """A fixed pool of `pool_size` distinct identities, families round-robin (item j: family j % F, index j // F).

    Pools are nested: `make_pool(s, f, 8, seed)` is a prefix of `make_pool(s, f, 88, seed)`, and every pool item is
    the same task `make_tasks(s, ...)` gives at that (family, index).
    """
    _check_split(split)
    names = resolve_families(families)
    if pool_size < 1:
        raise ValueError(f"pool_size must be >= 1, got {pool_size}")
    per_family = -(-pool_size // len(names))
    by_family = {family: _family_tasks(split, family, per_family, seed) for family in names}
    return [by_family[names[j % len(names)]][j // len(names)] for j in range(pool_size)]


def iter_train_tasks(
    families: Sequence[str] | str | None = None,
    seed: int = 0,
    *,
    pool_size: int | None = None,
    vary_body: bool = True,
    split: str = "train",
) -> Iterator[Task]:
    """Infinite deterministic stream of training tasks (use `task.text` as the example).

    - `pool_size=None`: every example is a fresh identity (maximum diversity). The stream runs in rounds; each
      round visits every family once in a shuffled order, so families are exactly balanced every len(families)
      examples. The k-th visit to a family yields `make_task(split, family, k, seed)`.
    - `pool_size=N`: examples cycle over the fixed pool `make_pool(split, families, N, seed)`, reshuffled every
      epoch; equal step counts then compare repeated (small N) against diverse (large N) data.
    - `vary_body`: each example shows a reference body drawn at random from its family (else the identity's own).
    """
    _check_split(split)
    names = resolve_families(families)
    rng = random.Random(f"stream/{split}/{seed}/{pool_size}")

    def finish(task: Task) -> Task:
        if vary_body:
            return task.with_body(rng.randrange(len(get_family(task.family).bodies)))
        return task

    if pool_size is None:
        counts = dict.fromkeys(names, 0)
        while True:
            order = list(names)
            rng.shuffle(order)
            for family in order:
                task = make_task(split, family, counts[family], seed)
                counts[family] += 1
                yield finish(task)
    else:
        pool = make_pool(split, names, pool_size, seed)
        while True:
            order = list(pool)
            rng.shuffle(order)
            for task in order:
                yield finish(task)


def values_match(actual: Any, expected: Any) -> bool:
    """Exact comparison as the hidden tests mean it: same type (True is not 1), same value, recursively for lists."""
    if type(actual) is not type(expected):
        return False
    if isinstance(expected, (list, tuple)):
        return len(actual) == len(expected) and all(values_match(a, e) for a, e in zip(actual, expected))
    if isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(values_match(actual[k], expected[k]) for k in expected)
    return bool(actual == expected)
