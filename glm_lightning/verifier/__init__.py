"""Sandboxed verifier: run untrusted candidate functions against hidden tests (stdlib only, no torch).

    from glm_lightning.verifier import Verifier, Verdict
    with Verifier(timeout_s=2.0, memory_mb=256, workers=2) as v:
        verdict = v.check(source, "entry_point", [((1,), 2), ((2,), 3)])

Layout (one concept per file): verdict.py (result type), protocol.py (type-tagged encoding), guards.py (audit
hook: error messages), seccomp.py (the kernel's syscall allowlist), child.py (confinement + candidate runner inside
the sandbox), launcher.py (namespaces, private root and tmpfs, then exec of the zygote), procview.py (the private
/proc view), zygote.py (fork server), cleanup.py (iterative removal of what candidates leave), uids.py (a kernel uid
per job from leased blocks), defences.py (the issue-46 defences and their test-only switch), pool.py (parent-side
process management, scheduling, fork/thread/close safety), judge.py (strict, bounded result checking), verifier.py
(public API). See docs/verifier.md for the design, the threat-model table and the fallback.
"""

from .pool import ForeignProcessError, VerifierClosedError
from .verdict import Verdict
from .verifier import Verifier, WeakerSandboxError

__all__ = ["ForeignProcessError", "Verdict", "Verifier", "VerifierClosedError", "WeakerSandboxError"]
