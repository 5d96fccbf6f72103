"""Registry of small Python function families.

A family is one algorithm ("add one", "reverse a string", ...) with several English paraphrases, several choices of
argument names, several equivalent reference bodies and a fixed set of hidden tests. A *task* (see `task.py`) is one
identity drawn from a family: a function name, one description, one choice of argument names.

Templates use placeholders named after the family's `params`: single-argument families use `{arg}`, multi-argument
families name each position (e.g. `{a}`, `{b}` or `{x}`, `{lo}`, `{hi}`). Only `{name}` for a name in `params` is
substituted, so literal braces elsewhere would be left alone (no body uses any).

Bodies are unindented Python statements (one or a few lines; nested lines carry their own 4-space indentation). The
first body of each family sticks to the conservative subset the tutorial's verifier accepted where the algorithm
allows it (no attribute access, no statement loops, calls only to sum/len/abs/min/max/bool/int/str); later bodies
are free to use loops, comprehensions, methods and other builtins. `to_upper` cannot avoid a method call.

Every expected value is a plain JSON type (int, bool, str, list) with the exact type the function must return:
`True` is not `1`. The 8 tutorial families keep the tutorial's 3 hidden tests as their first 3 cases.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

KINDS: tuple[str, ...] = ("int", "str", "list", "bool")

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def fill(template: str, mapping: dict[str, str]) -> str:
    """Replace `{key}` for every key of `mapping`; other text (including other braces) is left as is."""
    return _PLACEHOLDER.sub(lambda m: mapping.get(m.group(1), m.group(0)), template)


@dataclass(frozen=True)
class Family:
    """One function family. `arg_names` is normalised to a tuple of tuples (one tuple per alternative)."""

    name: str
    descriptions: tuple[str, ...]
    arg_names: tuple[tuple[str, ...], ...]
    bodies: tuple[str, ...]
    tests: tuple[tuple[tuple[Any, ...], Any], ...] = field(hash=False)
    difficulty: int
    kind: str
    params: tuple[str, ...] = ("arg",)

    def __post_init__(self) -> None:
        names = tuple((choice,) if isinstance(choice, str) else tuple(choice) for choice in self.arg_names)
        object.__setattr__(self, "arg_names", names)
        object.__setattr__(self, "descriptions", tuple(self.descriptions))
        object.__setattr__(self, "bodies", tuple(self.bodies))
        object.__setattr__(self, "params", tuple(self.params))
        object.__setattr__(self, "tests", tuple((tuple(args), expected) for args, expected in self.tests))
        if not self.name.isidentifier():
            raise ValueError(f"family name {self.name!r} is not an identifier")
        if self.kind not in KINDS:
            raise ValueError(f"family {self.name}: kind {self.kind!r} not in {KINDS}")
        if self.difficulty not in (1, 2, 3):
            raise ValueError(f"family {self.name}: difficulty must be 1, 2 or 3")
        if not self.descriptions or not self.bodies or not self.arg_names or not self.tests:
            raise ValueError(f"family {self.name}: descriptions, bodies, arg_names and tests must be non-empty")
        for choice in self.arg_names:
            if len(choice) != len(self.params):
                raise ValueError(f"family {self.name}: arg choice {choice} does not match params {self.params}")
            if len(set(choice)) != len(choice) or not all(a.isidentifier() for a in choice):
                raise ValueError(f"family {self.name}: bad arg choice {choice}")
        for args, _ in self.tests:
            if len(args) != len(self.params):
                raise ValueError(f"family {self.name}: test args {args} do not match params {self.params}")

    @property
    def arity(self) -> int:
        return len(self.params)

    def mapping(self, arg_index: int) -> dict[str, str]:
        """Placeholder -> argument name for the `arg_index`-th choice of names."""
        return dict(zip(self.params, self.arg_names[arg_index]))

    def render_description(self, description_index: int, arg_index: int) -> str:
        return fill(self.descriptions[description_index], self.mapping(arg_index))

    def render_body(self, body_index: int, arg_index: int) -> str:
        return fill(self.bodies[body_index], self.mapping(arg_index))


_INT_ARGS = ("x", "n", "value", "num")
_STR_ARGS = ("text", "s", "word")
_LIST_ARGS = ("values", "nums", "numbers", "items")

_ALL: tuple[Family, ...] = (
    # ---- the 8 tutorial families -------------------------------------------------------------------------------
    Family(
        "increment",
        descriptions=(
            "Return {arg} plus one.",
            "Increase {arg} by one.",
            "Add one to {arg} and return the result.",
            "Return the integer that comes after {arg}.",
        ),
        arg_names=_INT_ARGS,
        bodies=("return {arg} + 1", "return 1 + {arg}"),
        tests=(((-3,), -2), ((0,), 1), ((7,), 8), ((-1,), 0), ((99,), 100), ((1000,), 1001)),
        difficulty=1,
        kind="int",
    ),
    Family(
        "double",
        descriptions=(
            "Return two times {arg}.",
            "Double {arg}.",
            "Multiply {arg} by two.",
            "Return {arg} added to itself.",
        ),
        arg_names=_INT_ARGS,
        bodies=("return {arg} * 2", "return 2 * {arg}", "return {arg} + {arg}"),
        tests=(((-4,), -8), ((0,), 0), ((6,), 12), ((1,), 2), ((-1,), -2), ((50,), 100)),
        difficulty=1,
        kind="int",
    ),
    Family(
        "square",
        descriptions=(
            "Return {arg} squared.",
            "Multiply {arg} by itself.",
            "Return the square of {arg}.",
        ),
        arg_names=_INT_ARGS,
        bodies=("return {arg} * {arg}", "return {arg} ** 2"),
        tests=(((-4,), 16), ((0,), 0), ((5,), 25), ((1,), 1), ((-1,), 1), ((12,), 144)),
        difficulty=1,
        kind="int",
    ),
    Family(
        "absolute",
        descriptions=(
            "Return the absolute value of {arg}.",
            "Make a negative {arg} positive.",
            "Return {arg} without its sign.",
        ),
        arg_names=_INT_ARGS,
        bodies=(
            "return -{arg} if {arg} < 0 else {arg}",
            "return abs({arg})",
            "return {arg} if {arg} >= 0 else -{arg}",
        ),
        tests=(((-7,), 7), ((0,), 0), ((9,), 9), ((-1,), 1), ((1,), 1), ((-100,), 100)),
        difficulty=1,
        kind="int",
    ),
    Family(
        "nonnegative",
        descriptions=(
            "Clamp {arg} to at least zero.",
            "Return zero when {arg} is negative, otherwise {arg}.",
            "Return the larger of {arg} and zero.",
        ),
        arg_names=_INT_ARGS,
        bodies=("return {arg} if {arg} > 0 else 0", "return max({arg}, 0)", "return max(0, {arg})"),
        tests=(((-5,), 0), ((0,), 0), ((8,), 8), ((-1,), 0), ((1,), 1), ((42,), 42)),
        difficulty=1,
        kind="int",
    ),
    Family(
        "even",
        descriptions=(
            "Return whether {arg} is even.",
            "Check if {arg} is divisible by two.",
            "Return True if {arg} is even, else False.",
        ),
        arg_names=_INT_ARGS,
        bodies=("return {arg} % 2 == 0", "return not {arg} % 2", "return {arg} % 2 != 1"),
        tests=(((-3,), False), ((0,), True), ((8,), True), ((7,), False), ((-4,), True), ((1,), False)),
        difficulty=1,
        kind="bool",
    ),
    Family(
        "reverse",
        descriptions=(
            "Return {arg} in reverse order.",
            "Reverse the string {arg}.",
            "Return the characters of {arg} from last to first.",
        ),
        arg_names=_STR_ARGS,
        bodies=("return {arg}[::-1]", "return ''.join(reversed({arg}))"),
        tests=(
            (("",), ""),
            (("abc",), "cba"),
            (("level",), "level"),
            (("a",), "a"),
            (("ab",), "ba"),
            (("Hello world",), "dlrow olleH"),
        ),
        difficulty=1,
        kind="str",
    ),
    Family(
        "list_sum",
        descriptions=(
            "Return the sum of {arg}.",
            "Add every number in the list {arg}.",
            "Return the total of {arg}.",
        ),
        arg_names=_LIST_ARGS,
        bodies=(
            "return sum({arg})",
            "t = 0\nfor v in {arg}:\n    t += v\nreturn t",
        ),
        tests=((([],), 0), (([1, 2, 3],), 6), (([-2, 5],), 3), (([0],), 0), (([10],), 10), (([-1, -2, -3],), -6)),
        difficulty=1,
        kind="int",
    ),
    # ---- further integer families ------------------------------------------------------------------------------
    Family(
        "decrement",
        descriptions=(
            "Return {arg} minus one.",
            "Decrease {arg} by one.",
            "Subtract one from {arg} and return the result.",
            "Return the integer that comes before {arg}.",
        ),
        arg_names=_INT_ARGS,
        bodies=("return {arg} - 1", "return -1 + {arg}"),
        tests=(((0,), -1), ((1,), 0), ((7,), 6), ((-3,), -4), ((100,), 99), ((-1,), -2)),
        difficulty=1,
        kind="int",
    ),
    Family(
        "triple",
        descriptions=(
            "Return three times {arg}.",
            "Triple {arg}.",
            "Multiply {arg} by three.",
        ),
        arg_names=_INT_ARGS,
        bodies=("return {arg} * 3", "return 3 * {arg}", "return {arg} + {arg} + {arg}"),
        tests=(((0,), 0), ((1,), 3), ((-2,), -6), ((5,), 15), ((-1,), -3), ((33,), 99)),
        difficulty=1,
        kind="int",
    ),
    Family(
        "halve",
        descriptions=(
            "Return {arg} divided by two, rounded down.",
            "Return the floor of half of {arg}.",
            "Integer-divide {arg} by two.",
        ),
        arg_names=_INT_ARGS,
        bodies=("return {arg} // 2", "return {arg} >> 1", "return ({arg} - {arg} % 2) // 2"),
        tests=(((0,), 0), ((7,), 3), ((8,), 4), ((-7,), -4), ((-8,), -4), ((1,), 0), ((-1,), -1)),
        difficulty=2,
        kind="int",
    ),
    Family(
        "sign",
        descriptions=(
            "Return 1 if {arg} is positive, -1 if negative, else 0.",
            "Return the sign of {arg} as -1, 0 or 1.",
            "Return -1, 0 or 1 for {arg} below, at or above zero.",
        ),
        arg_names=_INT_ARGS,
        bodies=(
            "return 1 if {arg} > 0 else -1 if {arg} < 0 else 0",
            "return ({arg} > 0) - ({arg} < 0)",
        ),
        tests=(((-5,), -1), ((0,), 0), ((3,), 1), ((-1,), -1), ((1,), 1), ((100,), 1)),
        difficulty=2,
        kind="int",
    ),
    Family(
        "clamp",
        descriptions=(
            "Return {x} limited to the range {lo} to {hi}.",
            "Clamp {x} between {lo} and {hi}.",
            "Return {x}, but at least {lo} and at most {hi}.",
        ),
        arg_names=(("x", "lo", "hi"), ("n", "low", "high"), ("v", "lo", "hi")),
        params=("x", "lo", "hi"),
        bodies=(
            "return max({lo}, min({x}, {hi}))",
            "return min(max({x}, {lo}), {hi})",
            "return {lo} if {x} < {lo} else {hi} if {x} > {hi} else {x}",
        ),
        tests=(
            ((5, 0, 10), 5),
            ((-3, 0, 10), 0),
            ((15, 0, 10), 10),
            ((0, 0, 10), 0),
            ((10, 0, 10), 10),
            ((-7, -5, 5), -5),
            ((3, 3, 3), 3),
        ),
        difficulty=3,
        kind="int",
    ),
    Family(
        "max_of_two",
        descriptions=(
            "Return the larger of {a} and {b}.",
            "Return the maximum of {a} and {b}.",
            "Return {a} if it exceeds {b}, else {b}.",
        ),
        arg_names=(("a", "b"), ("x", "y"), ("p", "q"), ("m", "n")),
        params=("a", "b"),
        bodies=("return {a} if {a} > {b} else {b}", "return max({a}, {b})", "return max({b}, {a})"),
        tests=(((1, 2), 2), ((5, 3), 5), ((-1, -4), -1), ((0, 0), 0), ((7, 7), 7), ((-3, 2), 2)),
        difficulty=2,
        kind="int",
    ),
    Family(
        "add",
        descriptions=(
            "Return the sum of {a} and {b}.",
            "Add {a} and {b}.",
            "Return {a} plus {b}.",
        ),
        arg_names=(("a", "b"), ("x", "y"), ("left", "right"), ("m", "n")),
        params=("a", "b"),
        bodies=("return {a} + {b}", "return {b} + {a}"),
        tests=(((1, 2), 3), ((0, 0), 0), ((-4, 4), 0), ((-2, -3), -5), ((10, -1), 9), ((7, 0), 7)),
        difficulty=1,
        kind="int",
    ),
    Family(
        "square_plus_one",
        descriptions=(
            "Return {arg} squared plus one.",
            "Multiply {arg} by itself and add one.",
            "Return one more than the square of {arg}.",
        ),
        arg_names=_INT_ARGS,
        bodies=("return {arg} * {arg} + 1", "return {arg} ** 2 + 1", "return 1 + {arg} * {arg}"),
        tests=(((0,), 1), ((1,), 2), ((-1,), 2), ((3,), 10), ((-4,), 17), ((10,), 101)),
        difficulty=2,
        kind="int",
    ),
    # ---- boolean families --------------------------------------------------------------------------------------
    Family(
        "divisible_by_three",
        descriptions=(
            "Return whether {arg} is divisible by three.",
            "Check if {arg} is a multiple of three.",
            "Return True if three divides {arg} evenly, else False.",
        ),
        arg_names=_INT_ARGS,
        bodies=("return {arg} % 3 == 0", "return not {arg} % 3"),
        tests=(((0,), True), ((3,), True), ((4,), False), ((-3,), True), ((-4,), False), ((9,), True), ((10,), False)),
        difficulty=1,
        kind="bool",
    ),
    Family(
        "is_positive",
        descriptions=(
            "Return whether {arg} is greater than zero.",
            "Check if {arg} is positive.",
            "Return True if {arg} is above zero, else False.",
        ),
        arg_names=_INT_ARGS,
        bodies=("return {arg} > 0", "return 0 < {arg}"),
        tests=(((-1,), False), ((0,), False), ((1,), True), ((100,), True), ((-100,), False)),
        difficulty=1,
        kind="bool",
    ),
    Family(
        "is_palindrome",
        descriptions=(
            "Return whether {arg} reads the same forwards and backwards.",
            "Check if the string {arg} is a palindrome.",
            "Return True if {arg} equals its own reverse, else False.",
        ),
        arg_names=_STR_ARGS,
        bodies=("return {arg} == {arg}[::-1]", "return {arg}[::-1] == {arg}"),
        tests=(
            (("",), True),
            (("a",), True),
            (("level",), True),
            (("abc",), False),
            (("ab",), False),
            (("noon",), True),
            (("abca",), False),
        ),
        difficulty=2,
        kind="bool",
    ),
    # ---- string families ---------------------------------------------------------------------------------------
    Family(
        "count_vowels",
        descriptions=(
            "Count the vowels (aeiou, any case) in {arg}.",
            "Count the vowels in {arg}, upper or lower case.",
            "Return how many letters of {arg} are in aeiouAEIOU.",
        ),
        arg_names=_STR_ARGS,
        bodies=(
            "return sum(1 for c in {arg} if c in 'aeiouAEIOU')",
            "return len([c for c in {arg} if c in 'aeiouAEIOU'])",
        ),
        tests=(
            (("",), 0),
            (("hello",), 2),
            (("sky",), 0),
            (("AEIOU",), 5),
            (("banana",), 3),
            (("Python code",), 3),
        ),
        difficulty=3,
        kind="int",
    ),
    Family(
        "first_char",
        descriptions=(
            "Return the first character of {arg}, or '' if it is empty.",
            "Return the opening character of {arg} ('' if empty).",
            "Return the first letter of {arg}, or an empty string.",
        ),
        arg_names=_STR_ARGS,
        bodies=("return {arg}[:1]", "return {arg}[0] if {arg} else ''"),
        tests=((("",), ""), (("abc",), "a"), (("z",), "z"), (("Hello",), "H"), ((" x",), " ")),
        difficulty=2,
        kind="str",
    ),
    Family(
        "to_upper",
        descriptions=(
            "Return {arg} in upper case.",
            "Convert every letter of {arg} to a capital letter.",
            "Return {arg} with all lowercase letters made uppercase.",
        ),
        arg_names=_STR_ARGS,
        bodies=("return {arg}.upper()", "return str.upper({arg})"),
        tests=(
            (("",), ""),
            (("abc",), "ABC"),
            (("Hello World",), "HELLO WORLD"),
            (("ABC",), "ABC"),
            (("a1b2",), "A1B2"),
        ),
        difficulty=1,
        kind="str",
    ),
    Family(
        "concat_twice",
        descriptions=(
            "Return {arg} repeated twice.",
            "Return {arg} joined to a copy of itself.",
            "Concatenate {arg} with {arg}.",
        ),
        arg_names=_STR_ARGS,
        bodies=("return {arg} + {arg}", "return {arg} * 2", "return 2 * {arg}"),
        tests=((("",), ""), (("ab",), "abab"), (("x",), "xx"), (("hi ",), "hi hi "), (("Ok",), "OkOk")),
        difficulty=1,
        kind="str",
    ),
    Family(
        "string_length",
        descriptions=(
            "Return the number of characters in {arg}.",
            "Return the length of the string {arg}.",
            "Count how many characters {arg} has.",
        ),
        arg_names=_STR_ARGS,
        bodies=("return len({arg})", "return sum(1 for _ in {arg})"),
        tests=((("",), 0), (("a",), 1), (("hello",), 5), (("hi there",), 8), (("  ",), 2)),
        difficulty=1,
        kind="int",
    ),
    # ---- list families -----------------------------------------------------------------------------------------
    Family(
        "list_length",
        descriptions=(
            "Return the number of elements in {arg}.",
            "Return the length of the list {arg}.",
            "Count the items in the list {arg}.",
        ),
        arg_names=_LIST_ARGS,
        bodies=("return len({arg})", "return sum(1 for _ in {arg})"),
        tests=((([],), 0), (([1],), 1), (([1, 2, 3],), 3), (([0, 0, 0, 0],), 4), (([-1, 5],), 2)),
        difficulty=1,
        kind="int",
    ),
    Family(
        "last_element",
        descriptions=(
            "Return the last element of the non-empty list {arg}.",
            "Return the final item of {arg}.",
            "Return the element at the end of the list {arg}.",
        ),
        arg_names=_LIST_ARGS,
        bodies=("return {arg}[-1]", "return {arg}[len({arg}) - 1]"),
        tests=((([1, 2, 3],), 3), (([5],), 5), (([-1, 0],), 0), (([7, -7],), -7), (([0, 0, 9],), 9)),
        difficulty=1,
        kind="int",
    ),
    Family(
        "min_of_list",
        descriptions=(
            "Return the smallest number in {arg}.",
            "Find the minimum of the non-empty list {arg}.",
            "Return the least element of {arg}.",
        ),
        arg_names=_LIST_ARGS,
        bodies=(
            "return min({arg})",
            "return sorted({arg})[0]",
        ),
        tests=(
            (([3, 1, 2],), 1),
            (([5],), 5),
            (([-1, -7, 4],), -7),
            (([0, 0],), 0),
            (([10, 20, 30],), 10),
            (([2, -2],), -2),
        ),
        difficulty=2,
        kind="int",
    ),
    Family(
        "max_of_list",
        descriptions=(
            "Return the largest number in {arg}.",
            "Find the maximum of the non-empty list {arg}.",
            "Return the greatest element of {arg}.",
        ),
        arg_names=_LIST_ARGS,
        bodies=(
            "return max({arg})",
            "return sorted({arg})[-1]",
        ),
        tests=(
            (([3, 1, 2],), 3),
            (([5],), 5),
            (([-1, -7, -4],), -1),
            (([0, 0],), 0),
            (([10, 20, 30],), 30),
            (([2, -2],), 2),
        ),
        difficulty=2,
        kind="int",
    ),
    Family(
        "double_each",
        descriptions=(
            "Return a list with every number in {arg} doubled.",
            "Multiply each element of {arg} by two.",
            "Return the list of twice each value in {arg}.",
        ),
        arg_names=_LIST_ARGS,
        bodies=(
            "return [v * 2 for v in {arg}]",
            "return [2 * v for v in {arg}]",
            "return [v + v for v in {arg}]",
        ),
        tests=(
            (([],), []),
            (([1, 2, 3],), [2, 4, 6]),
            (([-1, 0],), [-2, 0]),
            (([5],), [10]),
            (([7, -7, 7],), [14, -14, 14]),
        ),
        difficulty=3,
        kind="list",
    ),
    Family(
        "keep_positive",
        descriptions=(
            "Return the positive numbers of {arg}, in order.",
            "Drop every number that is not positive from {arg}.",
            "Return a list of the positive elements of {arg}.",
        ),
        arg_names=_LIST_ARGS,
        bodies=(
            "return [v for v in {arg} if v > 0]",
            "return [v for v in {arg} if 0 < v]",
        ),
        tests=(
            (([],), []),
            (([1, -2, 3],), [1, 3]),
            (([-1, 0, -5],), []),
            (([4, 4],), [4, 4]),
            (([0, 2, 0, -2, 9],), [2, 9]),
        ),
        difficulty=3,
        kind="list",
    ),
)

FAMILIES: dict[str, Family] = {family.name: family for family in _ALL}
if len(FAMILIES) != len(_ALL):  # pragma: no cover - guards against a copy-paste duplicate
    raise RuntimeError("duplicate family name in the registry")

# The tutorial's 8 families, in the tutorial's order.
CLASSIC_FAMILIES: tuple[str, ...] = (
    "increment",
    "double",
    "square",
    "absolute",
    "nonnegative",
    "even",
    "reverse",
    "list_sum",
)
# The tutorial trained RL on these three and monitored the other classic families for interference.
RL_FAMILIES: tuple[str, ...] = ("increment", "double", "even")
# A suggested set of families to keep out of pre-training and report separately: each is a near neighbour of a
# pre-trained family (decrement ~ increment, triple ~ double, square_plus_one ~ square + increment,
# max_of_list ~ min_of_list), so a small model has some chance of composing them from the description.
HELD_OUT_FAMILIES: tuple[str, ...] = ("decrement", "triple", "square_plus_one", "max_of_list")
PRETRAIN_FAMILIES: tuple[str, ...] = tuple(name for name in FAMILIES if name not in HELD_OUT_FAMILIES)


def family_names(*, max_difficulty: int | None = None, kind: str | None = None) -> tuple[str, ...]:
    """All family names in registry order, optionally only those up to `max_difficulty` and/or of one `kind`."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    return tuple(
        name
        for name, family in FAMILIES.items()
        if (max_difficulty is None or family.difficulty <= max_difficulty) and (kind is None or family.kind == kind)
    )


def get_family(name: str) -> Family:
    """The family called `name`; ValueError listing the valid names otherwise."""
    try:
        return FAMILIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown task family {name!r}; valid families: {', '.join(FAMILIES)}") from None


def resolve_families(families: Sequence[str] | str | None = None) -> tuple[str, ...]:
    """Validate a selection of families. None -> all; a string may be comma-separated ("increment,double").

    Duplicates are dropped (first occurrence kept); an empty selection or an unknown name raises ValueError.
    """
    if families is None:
        return tuple(FAMILIES)
    if isinstance(families, str):
        families = [part.strip() for part in families.split(",") if part.strip()]
    names: list[str] = []
    for name in families:
        get_family(name)
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("empty family selection")
    return tuple(names)
