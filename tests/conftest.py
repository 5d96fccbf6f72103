import sys

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _quiet_argv_and_threads():
    """LightningCLI warns when sys.argv holds pytest's own arguments; tests pass args explicitly."""
    old = sys.argv
    sys.argv = ["pytest"]
    torch.set_num_threads(1)  # tests run tiny ops: one thread avoids OpenMP spin-wait overhead on 2 shared cores
    yield
    sys.argv = old
