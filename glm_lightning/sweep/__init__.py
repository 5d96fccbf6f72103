"""Seed sweeps of a stage config with paired statistics: `python -m glm_lightning sweep --config <study>.yaml`.

- `study`: the study file format, loading and validation (`load_study`, `validate_config`, `StudyError`);
- `runner`: one isolated subprocess per (variant, seed), resumable via DONE.json, local or Ray backend;
- `events`: reading TensorBoard scalars back;
- `analysis`: per-variant t-intervals, paired bootstrap + exact sign-flip tests against the control, Holm;
- `report`: REPORT.md, charts, TensorBoard hparams;
- `cli`: `main(argv)` / `run_sweep(argv)`;
- `claims`: the tutorial's claims a study tests and the verdict rule;
- `findings`: `sweep findings`, the one findings table (docs/results/README.md) from saved results.

See docs/sweeps.md.
"""

from glm_lightning.sweep.cli import main, run_sweep
from glm_lightning.sweep.study import StudyError, load_study, validate_config

__all__ = ["StudyError", "load_study", "main", "run_sweep", "validate_config"]
