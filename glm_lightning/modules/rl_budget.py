"""What ends an RL run: a budget of optimizer steps (`trainer.max_steps`), or of completions or prompts drawn.

Why both: `max_steps` counts optimizer steps, and a batch whose groups all have equal rewards makes no step, so a
step budget keeps drawing prompts while rewards are flat. In the RL screen (issue 47) arms planned at 128
completions drew 128-384 before their last evaluation, more where the model was more often all-right or all-wrong.
The tutorial's screen fixes completions: a zero-spread group is skipped for the update but still counted. A
completion (or prompt) budget counts every group drawn, skipped or not, and stops the run after the batch that
reaches it; whichever budget ends a run, Lightning then runs one last validation, so every arm is evaluated after
its last update (`BudgetCounter.end_of_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

UNITS = ("steps", "completions", "prompts")


@dataclass(frozen=True)
class Budget:
    """The run's budget when it is not optimizer steps: set one of the two (both null = `trainer.max_steps`)."""

    completions: int | None = None
    """Sampled completions (prompts x G), skipped zero-spread groups included; needs `trainer.max_steps: -1`."""
    prompts: int | None = None
    """Prompt groups drawn, skipped ones included; needs `trainer.max_steps: -1`."""

    def __post_init__(self) -> None:
        for name in ("completions", "prompts"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"budget.{name} must be an int >= 1 or null, got {value!r}")
        if self.completions is not None and self.prompts is not None:
            raise ValueError("set one RL budget: budget.completions or budget.prompts, not both")

    @property
    def unit(self) -> str:
        """`completions`, `prompts` or `steps` (trainer.max_steps)."""
        return "completions" if self.completions is not None else "prompts" if self.prompts is not None else "steps"


@dataclass
class BudgetCounter:
    """Running counts of one run: prompts and completions drawn (every group, skipped or not) and optimizer steps."""

    budget: Budget
    prompts: int = 0
    completions: int = 0

    def check_trainer(self, max_steps: int, fast_dev_run: Any = False) -> None:
        """A config names one budget: a completion/prompt budget with a finite `trainer.max_steps` is refused."""
        if self.budget.unit != "steps" and max_steps not in (-1, None) and not fast_dev_run:
            raise ValueError(f"budget.{self.budget.unit} is set, so set trainer.max_steps: -1 (got {max_steps}): "
                             "a config says which budget ends the run")

    def count(self, prompts: int, group_size: int) -> None:
        """Count one batch (summed over ranks): `prompts` groups of `group_size` completions each."""
        self.prompts += prompts
        self.completions += prompts * group_size

    def spent(self) -> bool:
        """True once the completion or prompt budget is reached (never for a step budget)."""
        b = self.budget
        if b.completions is not None:
            return self.completions >= b.completions
        return b.prompts is not None and self.prompts >= b.prompts

    def end_of_batch(self, trainer: Any, optimizer_steps: int) -> bool:
        """After a batch: stop the run (`trainer.should_stop`, which makes Lightning validate once more at this
        batch) when the budget is spent, or the step budget is reached. Returns True when it stops the run."""
        steps_done = trainer.max_steps not in (-1, None) and optimizer_steps >= trainer.max_steps
        if self.spent() or steps_done:
            trainer.should_stop = True
            return True
        return False

    def logs(self, optimizer_steps: int) -> dict[str, float]:
        """Both counts, whichever budget the run has: `train/completions`, `train/prompts`, `train/optimizer_steps`."""
        return {"train/completions": float(self.completions), "train/prompts": float(self.prompts),
                "train/optimizer_steps": float(optimizer_steps)}

    def summary(self, optimizer_steps: int) -> str:
        b = self.budget
        limit = "trainer.max_steps" if b.unit == "steps" else f"{getattr(b, b.unit)} {b.unit}"
        short = "" if b.unit == "steps" or self.spent() else " (the prompts ran out before the budget)"
        return (f"budget {limit}: {self.completions} completions in {self.prompts} prompt groups, "
                f"{optimizer_steps} optimizer steps{short}")
