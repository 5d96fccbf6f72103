"""A stage module in a forked process (DDP, dataloader workers) builds its own verifier instead of using the one it
inherited (which belongs to the parent, and refuses a fork with ForeignProcessError)."""

from __future__ import annotations

import os
from types import SimpleNamespace

from glm_lightning.modules.base import StageModule


def test_a_verifier_inherited_through_fork_is_replaced_not_used():
    built: list[SimpleNamespace] = []

    class Settings:
        def build(self) -> SimpleNamespace:
            built.append(SimpleNamespace(owner_pid=os.getpid()))
            return built[-1]

    module = StageModule(preset="tiny", init_weights=None)
    module.verifier_settings = Settings()
    mine = module.verifier
    assert module.verifier is mine and len(built) == 1, "the process's own verifier is kept"
    module._verifier = SimpleNamespace(owner_pid=os.getpid() + 1)  # as after a fork: the parent's
    assert module.verifier is built[-1] and len(built) == 2 and module.verifier.owner_pid == os.getpid()
