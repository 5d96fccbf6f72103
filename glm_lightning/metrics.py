"""Evaluation metrics for executable tasks: the unbiased pass@k estimator and its torchmetrics aggregation.

pass@k (Chen et al. 2021, arXiv 2107.03374): with n samples of which c pass, the probability that at least one of k
samples drawn without replacement passes is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1 .. n} (1 - k / i)        (1.0 when n - c < k)

The product form never builds large binomials, so it is exact in float64 for any n. The plug-in
`1 - (1 - c/n)^k` is biased and is not used anywhere. pass@1 reduces to c / n.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchmetrics import Metric


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with `n` samples of which `c` passed (requires 1 <= k <= n, 0 <= c <= n)."""
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if n < 1:
        raise ValueError(f"need n >= 1 samples, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n (the estimator is undefined for k > n); got k={k}, n={n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


class PassAtK(Metric):
    """Mean unbiased pass@k over problems, for several k at once.

    `update(n, c)` takes per-problem sample counts and pass counts (ints, lists or 1-D tensors). States are float64
    sums with `dist_reduce_fx="sum"`, so the DDP reduction is exact whatever the sharding of problems over ranks.
    `compute()` returns `{"pass@k": tensor}` for every k (NaN before any update).

    Greedy pass rate is the special case `PassAtK(ks=(1,))` updated with n = 1, c = passed.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, ks: Sequence[int] = (1,), **kwargs) -> None:
        super().__init__(**kwargs)
        ks = tuple(int(k) for k in ks)
        if not ks or any(k < 1 for k in ks) or len(set(ks)) != len(ks):
            raise ValueError(f"ks must be distinct positive ints, got {ks}")
        self.ks = ks
        self.add_state("totals", default=torch.zeros(len(ks), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("problems", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, n: Sequence[int] | torch.Tensor, c: Sequence[int] | torch.Tensor) -> None:
        ns = [int(v) for v in (n.tolist() if isinstance(n, torch.Tensor) else n)]
        cs = [int(v) for v in (c.tolist() if isinstance(c, torch.Tensor) else c)]
        if len(ns) != len(cs):
            raise ValueError(f"n and c must have one entry per problem ({len(ns)} vs {len(cs)})")
        if ns and min(ns) < max(self.ks):
            raise ValueError(f"every problem needs n >= max(ks) = {max(self.ks)} samples; got n = {min(ns)}")
        add = torch.zeros(len(self.ks), dtype=torch.float64)
        for ni, ci in zip(ns, cs):
            add += torch.tensor([pass_at_k(ni, ci, k) for k in self.ks], dtype=torch.float64)
        self.totals += add.to(self.totals.device)
        self.problems += len(ns)

    def compute(self) -> dict[str, torch.Tensor]:
        mean = self.totals / self.problems if self.problems > 0 else torch.full_like(self.totals, float("nan"))
        return {f"pass@{k}": mean[i] for i, k in enumerate(self.ks)}
