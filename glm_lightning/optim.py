"""AdamW whose parameters share their step counters: torch's fused AdamW kernel, ~4x fewer dispatched ops per step.

Why: on CPU, `torch.optim.AdamW(fused=True)` advances every parameter's 0-dim `step` tensor with
`_foreach_add_(steps, 1)`, which has no CPU kernel and falls back to one `add_` per tensor, each converting the
scalar 1 to a tensor first (5 ops per parameter); the kernel then reads every step with `.item()` (2 ops per
parameter). For the study model (83 parameters) that is 583 ops, 13% of a training step, for an update that is
one kernel. Parameters that have taken the same steps have the same counter, so here they hold the *same* tensor:
it is advanced once (one `add_`), and the very same `torch._fused_adamw_` kernel updates the parameters, so the
result is bit for bit that of `torch.optim.AdamW(fused=True)` (tests/test_optim.py).

A counter is shared only by parameters that stepped together: a parameter without a gradient in some step (frozen
for a stage, unused expert) gets its own copy first, and counters loaded from a checkpoint (separate tensors) are
merged by value on the first step. Anything the fast path does not cover (amsgrad, maximize, a tensor lr, gradient
scaling, sparse or complex gradients, non-fp32 steps) runs torch's own `step`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor


class AdamW(torch.optim.AdamW):
    """`torch.optim.AdamW(..., fused=True)` with shared step counters (see module docstring). The class keeps the
    name AdamW, so Lightning's learning-rate monitor logs under `lr-AdamW/...` as before."""

    def __init__(self, params: Iterable[Any], **kwargs: Any) -> None:
        kwargs.setdefault("fused", True)
        super().__init__(params, **kwargs)
        self._one = torch.ones((), dtype=torch.float32)

    def _fast_path_ok(self, active: list[Tensor]) -> bool:
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            return False
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or not group["fused"] or isinstance(group["lr"], Tensor) \
                    or group.get("differentiable", False) or not group.get("decoupled_weight_decay", True):
                return False
            if any(isinstance(b, Tensor) for b in group["betas"]):
                return False
        return all(p.device.type == "cpu" and p.dtype == torch.float32 and not p.grad.is_sparse
                   and p.grad.dtype == torch.float32 and self._step_ok(self.state.get(p)) for p in active)

    @staticmethod
    def _step_ok(state: dict[str, Any] | None) -> bool:
        """A fresh state, or one whose counter is a 0-dim float32 CPU tensor (what the fused kernel reads)."""
        step = state.get("step") if state else None
        return step is None or (isinstance(step, Tensor) and step.dtype == torch.float32 and step.dim() == 0
                                and step.device.type == "cpu")

    def _init_state(self, p: Tensor, fresh_step: list[Tensor]) -> None:
        """torch's lazy state: zero moments and a float32 step counter (new parameters of one step share one)."""
        if not fresh_step:
            fresh_step.append(torch.zeros((), dtype=torch.float32, device=p.device))
        self.state[p].update(step=fresh_step[0], exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                             exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))

    def _shared_steps(self, active: list[Tensor]) -> list[Tensor]:
        """The distinct step tensors of the stepping parameters after un-sharing idle ones and merging equal ones."""
        held = {id(self.state[p]["step"]) for p in active}
        for group in self.param_groups:  # idle parameters must not advance with the ones they shared a counter with
            for p in group["params"]:
                state = self.state.get(p)
                if p.grad is None and state and id(state["step"]) in held:
                    state["step"] = state["step"].clone()
        uniq = {id(self.state[p]["step"]): self.state[p]["step"] for p in active}
        if len(uniq) > 1:  # e.g. just loaded from a checkpoint: one tensor per parameter again
            by_value: dict[float, Tensor] = {}
            for p in active:
                step = self.state[p]["step"]
                self.state[p]["step"] = by_value.setdefault(float(step), step)
            uniq = {id(s): s for s in by_value.values()}
        return list(uniq.values())

    def _unshare_steps(self) -> None:
        """One step tensor per parameter again, the layout torch's own step and other optimizers expect."""
        seen: set[int] = set()
        for state in self.state.values():
            step = state.get("step")
            if isinstance(step, Tensor):
                if id(step) in seen:
                    state["step"] = step.clone()
                seen.add(id(step))

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict with one step tensor per parameter (a checkpoint any AdamW can load)."""
        sd = super().state_dict()
        sd["state"] = {k: {**v, "step": v["step"].clone()} if isinstance(v.get("step"), Tensor) else v
                       for k, v in sd["state"].items()}
        return sd

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        active = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not self._fast_path_ok(active):
            self._unshare_steps()
            super().step()
        else:
            self._fused_step(active)
        # the fused kernel writes the parameters through their data pointers, which torch does not count: bump the
        # version counters, so that a cache keyed on them (generation.sampling_weights' bf16 copy) sees the update
        torch.autograd.graph.increment_version(active)
        return loss

    def _fused_step(self, active: list[Tensor]) -> None:
        """torch._fused_adamw_ over each group's stepping parameters, their step counters shared (module docstring)."""
        fresh: list[Tensor] = []
        for p in active:
            if not self.state.get(p):
                self._init_state(p, fresh)
        for step in self._shared_steps(active):
            step.add_(self._one)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self.state[p] for p in params]
            beta1, beta2 = group["betas"]
            torch._fused_adamw_(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                                [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                                lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                                eps=group["eps"], amsgrad=False, maximize=False)
