"""ParamsSummary: Lightning's model summary without the FLOPs column and "Total FLOPs: 0" line.

Lightning counts FLOPs only for a module with an `example_input_array`; the stage modules have none (their inputs
are token batches, images or prompts), so every summary showed 0 FLOPs, which reads as a measurement. The stage CLI
adds this summary to every run that keeps `enable_model_summary` on (Lightning then adds none of its own); where a
count is real (non-zero) it stays. The model's FLOPs per token are in docs/performance.md.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table


class ParamsSummary(ModelSummary):
    """The plain-text summary (layers, parameters, size, modes), FLOPs left out when Lightning could not count them."""

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        from lightning.pytorch.callbacks.model_summary import log

        if total_flops:
            return ModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                          total_training_modes, total_flops, **summarize_kwargs)
        columns = [col for col in summary_data if col[0] != "FLOPs"]
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes,
                                      total_flops, *columns)
        lines = table.split("\n")
        log.info("\n" + "\n".join(lines[:-1] if lines[-1].endswith("Total Flops") else lines))
        return None
