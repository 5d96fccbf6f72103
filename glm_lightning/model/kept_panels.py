"""The panel-packed weights of a model's cached decode, kept from one generation to the next.

Why: a decode step's few-row matmuls read their weights as panels (ops.matmul.packed, csrc/panel_matmul.cpp), packed
on first use. Packed afresh for every generation, that cost the first decode step of every ``generate`` call ~35 ms
of packing plus ~25 thousand page faults of fresh memory (flash-25m, 106 MB of fp32 panels, 1 thread, Intel Xeon):
~65 ms, 6-7% of a 16 x 48 call. Evaluation loops and benchmarks call ``generate`` many times on the same weights, so
the panels (and the KDA layers' concatenated input projections they are packed from) stay with the model, and each
generation packs only what changed since.

How a change is seen (:meth:`KeptPanels.refresh`, at every ``model.new_cache``): a panel is dropped when its weight
(for a derived matrix: any of its sources) has another version counter, storage, shape or dtype than when it was
packed, or when any of ~64 elements sampled evenly across it holds another value. The counter sees every in-place
write torch tracks (``optimizer.step()`` of torch's non-fused optimizers and of the project's AdamW,
``load_state_dict``, ``with torch.no_grad(): w.mul_(...)``); the sample sees the untracked writes that move most of a
weight (``w.data.copy_(...)``, a fused optimizer kernel: a trained step moves every element). An untracked write to
a few elements only is what neither sees: after one, call ``generation.weights_changed(model)`` (the contract of
generation's bf16 sampling copy too). Parameters that left the model are dropped with their panels.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

SAMPLES = 64
"""Elements sampled per source tensor (evenly strided, the first included) to see untracked writes."""

KEEP = True
"""Whether models keep their panels across generations (False: every generation packs afresh, as before; a switch
for benchmarks that time the first call's packing)."""


def _stamp(t: Tensor) -> tuple:
    return t._version, t.data_ptr(), tuple(t.shape), t.dtype


def _samples(tensors: Sequence[Tensor]) -> Tensor:
    """~SAMPLES elements of each tensor, evenly strided (the first included), concatenated: one op for them all."""
    return torch.cat([_strided(t) for t in tensors]) if tensors else torch.zeros(0)


def _strided(t: Tensor) -> Tensor:
    """~SAMPLES elements of t, evenly strided (the first included): a view where t is contiguous fp32."""
    n = t.numel()
    step = max(1, n // SAMPLES)
    if t.is_contiguous():  # one op: a strided view of the storage
        return t.as_strided((len(range(0, n, step)),), (step,)).float()
    return t.reshape(-1)[::step].float()


@dataclass
class _Kept:
    """A kept value (panels or a derived matrix) and the source tensors it was made from."""

    value: Tensor
    sources: tuple[Tensor, ...]


class KeptPanels:
    """One model's kept decode panels (weight -> panels, as the generation's ``PanelStore`` looks them up) and the
    derived matrices they were packed from, for one panel dtype, with what each source tensor looked like when
    something was made from it."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.panels: dict[Tensor, _Kept] = {}
        self.derived: dict[Hashable, _Kept] = {}
        self._derived_values: dict[Tensor, _Kept] = {}
        self._seen: dict[Tensor, tuple[tuple, Tensor]] = {}
        """source -> (its stamp, its sampled elements) when first used."""

    def _see(self, sources: Sequence[Tensor]) -> None:
        with torch.inference_mode(False), torch.no_grad():
            for src in sources:
                if src not in self._seen:
                    self._seen[src] = (_stamp(src), _strided(src).clone())  # a view would follow the weight

    def refresh(self, params: Sequence[Tensor]) -> None:
        """Drop whatever was made from weights that changed or left the model (``params``: its parameters now)."""
        live = {id(p) for p in params}
        seen = list(self._seen.items())
        fresh = {id(src): id(src) in live and _stamp(src) == stamp for src, (stamp, _) in seen}
        if seen:
            with torch.inference_mode(False), torch.no_grad():
                now = _samples([src for src, _ in seen])
                if not torch.equal(now, torch.cat([sample for _, (_, sample) in seen])):  # some moved: which?
                    for (src, (_, sample)), part in zip(seen, now.split([len(x[1][1]) for x in seen])):
                        fresh[id(src)] &= torch.equal(part, sample)

        def unchanged(kept: _Kept) -> bool:
            return all(fresh[id(src)] for src in kept.sources)

        self.derived = {k: v for k, v in self.derived.items() if unchanged(v)}
        self._derived_values = {v.value: v for v in self.derived.values()}
        self.panels = {w: v for w, v in self.panels.items() if unchanged(v)}
        self._seen = {src: held for src, held in self._seen.items() if fresh[id(src)]}

    def derive(self, key: Hashable, sources: Sequence[Tensor], build: Callable[[], Tensor]) -> Tensor:
        """``build()``'s matrix made from ``sources``, kept under ``key`` while they stay as they were (so that the
        panels packed from it are kept too); built afresh each time where a source is not a parameter."""
        sources = tuple(sources)
        if not all(isinstance(s, nn.Parameter) for s in sources):  # e.g. a LoRA-parametrized weight, computed anew
            with torch.inference_mode(False), torch.no_grad():    # on every access (in inference mode: no counter)
                return build()
        held = self.derived.get(key)
        if held is None or len(held.sources) != len(sources) or any(a is not b for a, b in zip(held.sources, sources)):
            self._see(sources)
            with torch.inference_mode(False), torch.no_grad():  # plain tensors, usable in and out of inference mode
                held = self.derived[key] = _Kept(build(), sources)
            self._derived_values[held.value] = held
        return held.value

    def keep(self, weight: Tensor, panels: Tensor) -> None:
        """Keep ``weight``'s panels: a parameter's or a derived matrix's (another tensor, e.g. a parametrized weight
        computed anew each call, is not kept: it would never be asked for again)."""
        derived = self._derived_values.get(weight)
        if derived is not None:
            self.panels[weight] = _Kept(panels, derived.sources)
        elif isinstance(weight, nn.Parameter):
            self._see((weight,))
            self.panels[weight] = _Kept(panels, (weight,))

    def __len__(self) -> int:
        return len(self.panels)


_kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kept_panels(model: nn.Module, dtype: torch.dtype) -> KeptPanels | None:
    """``model``'s kept panels of ``dtype``, refreshed against its parameters now (None with :data:`KEEP` off)."""
    if not KEEP:
        return None
    held = _kept.get(model)
    if held is None or held.dtype != dtype:
        held = _kept[model] = KeptPanels(dtype)
    held.refresh(list(model.parameters()))
    return held


def drop_kept_panels(model: nn.Module) -> None:
    """Free ``model``'s kept panels (they go with the model anyway; this frees them now, e.g. before a long
    training phase on a machine short of memory)."""
    _kept.pop(model, None)
