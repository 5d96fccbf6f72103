"""One corpus problem: a reference solution (as source text), its tests, and the single edit that makes a mutant.

Sources are strings on purpose: they run only inside the sandboxed verifier, never in the test process. The mutant is
described as an (old, new) text replacement applied exactly once, so each bug is a small, visible, realistic edit
of the reference (an off-by-one, a flipped comparison, a wrong operator, a dropped edge case).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

Test = tuple[tuple, Any]


@dataclass(frozen=True)
class Problem:
    """`name` is also the entry point; `bug` = (old, new) turns `source` into the mutant."""

    name: str
    source: str
    tests: list[Test]
    bug: tuple[str, str]

    @property
    def mutant(self) -> str:
        old, new = self.bug
        if self.source.count(old) != 1:
            raise ValueError(f"{self.name}: bug text {old!r} occurs {self.source.count(old)} times, expected once")
        return self.source.replace(old, new)


def problem(name: str, source: str, tests: list[Test], bug: tuple[str, str]) -> Problem:
    """Build a Problem from an indented triple-quoted source (dedented here so the data files read naturally)."""
    return Problem(name, textwrap.dedent(source).strip("\n") + "\n", list(tests), bug)
