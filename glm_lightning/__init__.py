"""glm-lightning: a PyTorch Lightning lab for a small GLM-5-style language+vision model on a CPU.

From Python: `glm_lightning.load(path)` gives a trained model (an export folder or any stage's checkpoint) with
`.generate(prompt)`; see `glm_lightning.pretrained`. The command line is `python -m glm_lightning --help`.
Nothing heavy is imported until used, so the command line answers at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from glm_lightning.pretrained import Pretrained

try:
    from importlib.metadata import PackageNotFoundError, version as _version

    __version__ = _version("glm-lightning")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"


def load(path: Any) -> Pretrained:
    """A trained model from an export folder (`python -m glm_lightning export`) or any stage's checkpoint, ready to
    generate: `glm_lightning.load(path).generate("def double(x):")`."""
    from glm_lightning.pretrained import load as _load

    return _load(path)
