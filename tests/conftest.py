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


def few_row_matmul_case(shape: tuple[int, int, int, int]) -> tuple:
    """(x [E, M, in], W [E, out, in], bias [E, out], counts [E]) for the few-row matmul ops (small_matmul,
    panel_matmul): counts cover 0..M (the first matrix full, the last empty), seeded."""
    E, M, n_in, n_out = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(E, M, n_in, generator=gen)
    W = torch.randn(E, n_out, n_in, generator=gen) * n_in ** -0.5
    bias = torch.randn(E, n_out, generator=gen)
    counts = torch.arange(E) if E > M else torch.randint(0, M + 1, (E,), generator=gen)
    counts[0], counts[-1] = M, 0
    return x, W, bias, counts
