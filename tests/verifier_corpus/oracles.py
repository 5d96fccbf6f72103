"""Obviously-correct brute-force formulas for expected values that are tedious to write by hand.

These run in the test process; they are independent of the reference sources (simple definitions, no cleverness), so
an agreement between a reference solution in the sandbox and these formulas is real evidence that both are right.
"""

from __future__ import annotations

import datetime
import math
from fractions import Fraction


def primes(n: int) -> list[int]:
    """Primes <= n by trial division over every smaller number."""
    return [p for p in range(2, n + 1) if all(p % d for d in range(2, p))]


def divisor_count(n: int) -> int:
    return sum(1 for d in range(1, n + 1) if n % d == 0)


def factorial_trailing_zeros(n: int) -> int:
    text = str(math.factorial(n))
    return len(text) - len(text.rstrip("0"))


def square_difference(n: int) -> int:
    """(1 + ... + n)^2 - (1^2 + ... + n^2) equals the sum of i*j over ordered pairs with i != j."""
    return sum(i * j for i in range(1, n + 1) for j in range(1, n + 1) if i != j)


def day_of_year(year: int, month: int, day: int) -> int:
    return datetime.date(year, month, day).timetuple().tm_yday


def digital_root(n: int) -> int:
    return 0 if n == 0 else 1 + (n - 1) % 9


def pascal_row(n: int) -> list[int]:
    return [math.comb(n, k) for k in range(n + 1)]


def max_subarray(nums: list[int]) -> int:
    return max(sum(nums[i:j]) for i in range(len(nums)) for j in range(i + 1, len(nums) + 1))


def product_except_self(nums: list[int]) -> list[int]:
    return [math.prod(nums[:i] + nums[i + 1:]) for i in range(len(nums))]


def prefix_medians(xs: list[int]) -> list[float]:
    out = []
    for k in range(1, len(xs) + 1):
        s = sorted(xs[:k])
        out.append(float(s[k // 2]) if k % 2 else (s[k // 2 - 1] + s[k // 2]) / 2)
    return out


def lis_length(nums: list[int]) -> int:
    """O(n^2) dynamic programme: longest strictly increasing subsequence ending at each index."""
    best = []
    for i, x in enumerate(nums):
        best.append(1 + max([best[j] for j in range(i) if nums[j] < x], default=0))
    return max(best, default=0)


def matmul(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    return [[sum(a[i][k] * b[k][j] for k in range(len(b))) for j in range(len(b[0]))] for i in range(len(a))]


def sliding_max(nums: list[int], k: int) -> list[int]:
    return [max(nums[i:i + k]) for i in range(len(nums) - k + 1)]


def josephus(n: int, k: int) -> list[int]:
    people, order, i = list(range(1, n + 1)), [], 0
    while people:
        i = (i + k - 1) % len(people)
        order.append(people.pop(i))
    return order


def tribonacci(n: int) -> int:
    seq = [0, 0, 1]
    while len(seq) <= n:
        seq.append(seq[-1] + seq[-2] + seq[-3])
    return seq[n]


def stair_ways(n: int, steps: list[int]) -> int:
    ways = [1] + [0] * n
    for k in range(1, n + 1):
        ways[k] = sum(ways[k - s] for s in steps if s <= k)
    return ways[n]


def fraction_sum(pairs: list[tuple[int, int]]) -> tuple[int, int]:
    total = sum((Fraction(n, d) for n, d in pairs), Fraction(0))
    return (total.numerator, total.denominator)


def trapped_water(h: list[int]) -> int:
    return sum(min(max(h[:i + 1]), max(h[i:])) - h[i] for i in range(len(h)))


def overlapping_count(text: str, sub: str) -> int:
    return sum(text.startswith(sub, i) for i in range(len(text)))


def collatz_length(n: int) -> int:
    """Number of terms in the Collatz sequence from n down to 1, both included."""
    terms = 1
    while n != 1:
        n = 3 * n + 1 if n % 2 else n // 2
        terms += 1
    return terms


def longest_collatz(limit: int) -> int:
    """The smallest start in 1..limit with the longest sequence."""
    lengths = {s: collatz_length(s) for s in range(1, limit + 1)}
    return min(s for s in lengths if lengths[s] == max(lengths.values()))
