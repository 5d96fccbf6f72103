import os
import sys

import pytest
import torch

# The shipped op table (glm_lightning/model/ops/choice.py), whatever was measured on this machine: the recorded numbers
# the tests compare with (sampled tokens, demo rows) were made with it. tests/test_op_choice.py unpins it per test.
os.environ.setdefault("GLM_LIGHTNING_OP_TABLE", "defaults")


@pytest.fixture(autouse=True, scope="session")
def _quiet_argv_and_threads():
    """LightningCLI warns when sys.argv holds pytest's own arguments; tests pass args explicitly. One thread from the
    start, so module-scoped fixtures (e.g. a reference run compared bit-for-bit) use the same count as the tests."""
    old = sys.argv
    sys.argv = ["pytest"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the stage CLIs then keep the count below (no start-up probe)
    torch.set_num_threads(1)  # tests run tiny ops: one thread avoids OpenMP spin-wait overhead on 2 shared cores
    yield
    sys.argv = old


@pytest.fixture(autouse=True)
def _one_thread():
    """Back to one thread after every test, so a test that changes the thread count cannot leak it into the next."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
