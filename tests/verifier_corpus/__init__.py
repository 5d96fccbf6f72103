"""A legitimate-solution corpus for the verifier (issue #15): reference solutions, tests and one mutant each.

Every reference must pass in the sandbox and every mutant must fail. Sources are data (strings) and never run in the
test process. Problems are grouped by theme, one module each; ALL is the whole corpus in a fixed order.
"""

from __future__ import annotations

from . import arithmetic, classes, closures, containers, generators, graphs, recursion, sequences, strings
from .problem import Problem

ALL: list[Problem] = [
    *arithmetic.PROBLEMS, *strings.PROBLEMS, *sequences.PROBLEMS, *recursion.PROBLEMS, *classes.PROBLEMS,
    *generators.PROBLEMS, *closures.PROBLEMS, *containers.PROBLEMS, *graphs.PROBLEMS,
]
