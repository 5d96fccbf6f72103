"""Explicit, checked equivalences between a config text runs were made under and the one shipped now (issue 47).

A run's identity covers its base config's text, so editing the shipped config makes its committed runs read as
runs of other settings. Rewriting their identities to the new text (as 01d5095 did) claims they ran under a config
they never saw. Instead a study lists `equivalences:` records, each naming the config, the commit holding the text
the runs ran under, the exact lines the edit added and removed, why the edit changes no result, and the rerun that
showed it. A committed run counts for the current config only when, checked here:
- the old text (read from git at `ran_at`) hashes to the config digest the run recorded in its fingerprint parts,
- the run's recorded identity is its identity under that old text (so the record covers this very run), and
- the old and current texts differ by exactly the lines the record lists (so it covers this very edit).
The findings table names the record in the row, and its notes show the record (`describe`).
"""

from __future__ import annotations

import difflib
import hashlib
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KEYS = {"config", "ran_at", "added", "removed", "reason", "rerun"}


class EquivalenceError(ValueError):
    """An equivalence record that does not check out; the message says which check failed."""


@dataclass(frozen=True)
class Equivalence:
    config: str
    """Repository path of the (base) config that was edited."""
    ran_at: str
    """A commit holding the text the runs ran under."""
    added: tuple[str, ...]
    removed: tuple[str, ...]
    reason: str
    rerun: str
    """The rerun that matched: which run, at which commit, what was compared."""

    def old_text(self, repo: Path) -> bytes:
        try:
            out = subprocess.run(["git", "show", f"{self.ran_at}:{self.config}"], cwd=repo, capture_output=True,
                                 timeout=30, check=True)
        except (OSError, subprocess.SubprocessError) as err:
            raise EquivalenceError(f"equivalence for {self.config}: cannot read it at {self.ran_at} from git "
                                   f"({err})") from None
        return out.stdout

    def check_edit(self, repo: Path) -> bytes:
        """The old text, after checking that it and the current text differ by exactly the listed lines."""
        old = self.old_text(repo)
        new = (repo / self.config).read_bytes()
        diff = list(difflib.ndiff(old.decode().splitlines(), new.decode().splitlines()))
        added = tuple(line[2:].strip() for line in diff if line.startswith("+ "))
        removed = tuple(line[2:].strip() for line in diff if line.startswith("- "))
        if sorted(added) != sorted(self.added) or sorted(removed) != sorted(self.removed):
            raise EquivalenceError(f"equivalence for {self.config} at {self.ran_at}: the edit since then added "
                                   f"{list(added)} and removed {list(removed)}, not the lines the record lists")
        return old

    def covers(self, run: dict[str, Any], old_text: bytes, identity_under: Callable[[bytes], str]) -> bool:
        """True when `run` (a committed run record) ran under the old text: its recorded config digest is the old
        text's and its recorded identity is its identity under that text."""
        digest = (run.get("parts") or {}).get("configs", {}).get(self.config)
        return digest == hashlib.sha256(old_text).hexdigest()[:16] and run.get("identity") == identity_under(old_text)

    def describe(self, old_identity: str, new_identity: str, n: int) -> str:
        return (f"{n} runs made under `{self.config}` as of {self.ran_at} count for its current text by an explicit "
                f"equivalence (e.g. identity {old_identity} as run, {new_identity} now; identities are never "
                f"rewritten): the edit added {list(self.added)} and removed {list(self.removed)}; why it changes no "
                f"result: {self.reason.rstrip('.')}; the rerun that matched: {self.rerun.rstrip('.')}")


def parse_equivalences(where: str, raw: Any) -> list[Equivalence]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError(f"{where}: `equivalences` must be a list of {{{', '.join(sorted(KEYS))}}}")
    out = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or set(entry) != KEYS:
            raise ValueError(f"{where}: equivalences[{i}] needs exactly the keys {sorted(KEYS)}, got "
                             f"{sorted(entry) if isinstance(entry, dict) else entry!r}")
        if not all(isinstance(entry[k], list) for k in ("added", "removed")):
            raise ValueError(f"{where}: equivalences[{i}].added/removed must be lists of lines")
        if not str(entry["reason"]).strip() or not str(entry["rerun"]).strip():
            raise ValueError(f"{where}: equivalences[{i}] needs a reason and the rerun that matched")
        out.append(Equivalence(str(entry["config"]), str(entry["ran_at"]),
                               tuple(str(x).strip() for x in entry["added"]),
                               tuple(str(x).strip() for x in entry["removed"]),
                               " ".join(str(entry["reason"]).split()), " ".join(str(entry["rerun"]).split())))
    return out
