"""The result of checking one candidate: what the trainer, the evaluation code and humans read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Status = Literal["passed", "failed", "invalid", "timeout", "error"]
STATUSES: tuple[str, ...] = ("passed", "failed", "invalid", "timeout", "error")


@dataclass(frozen=True)
class Verdict:
    """Outcome of one candidate.

    status: "passed" (every test matched with exact types), "failed" (ran, some test wrong or raised), "invalid"
    (does not compile or does not define the entry point as a function), "timeout" (wall-clock or CPU limit) or
    "error" (crashed, exceeded a resource limit, attempted a forbidden operation, or the sandbox broke).
    elapsed_s is informational and excluded from equality, so checking the same candidate twice compares equal.
    """

    status: Status
    passed_cases: int
    total_cases: int
    detail: str = ""
    elapsed_s: float = field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r}")

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def fraction(self) -> float:
        """Fraction of test cases that matched (0.0 when there are no cases)."""
        return self.passed_cases / self.total_cases if self.total_cases else 0.0
