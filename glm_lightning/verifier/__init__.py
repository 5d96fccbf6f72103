"""Sandboxed verifier: run untrusted candidate functions against hidden tests (stdlib only, no torch).

    from glm_lightning.verifier import Verifier, Verdict
    with Verifier(timeout_s=2.0, memory_mb=256, workers=2) as v:
        verdict = v.check(source, "entry_point", [((1,), 2), ((2,), 3)])

Layout (one concept per file): verdict.py (result type), protocol.py (type-tagged encoding), guards.py (audit
hook), child.py (confinement + candidate runner inside the sandbox), zygote.py (fork server), pool.py (parent-side
process management and scheduling), judge.py (strict result checking), verifier.py (public API). See
docs/verifier.md for the design and threat model.
"""

from .verdict import Verdict
from .verifier import Verifier

__all__ = ["Verdict", "Verifier"]
