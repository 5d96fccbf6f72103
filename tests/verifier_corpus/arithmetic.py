"""Number problems: number theory, digits, bases, dates and a little geometry (mostly with `math`)."""

from __future__ import annotations

from . import oracles
from .problem import problem

PROBLEMS = [
    problem("gcd_of_list", r"""
        import math
        from functools import reduce

        def gcd_of_list(xs):
            return reduce(math.gcd, xs, 0)
        """,
        [(([12, 18, 24],), 6), (([7],), 7), (([],), 0), (([0, 5],), 5), (([17, 34, 51],), 17)],
        ("xs, 0)", "xs, 1)")),
    problem("lcm_range", r"""
        import math

        def lcm_range(n):
            result = 1
            for k in range(2, n + 1):
                result = result * k // math.gcd(result, k)
            return result
        """,
        [((0,), 1), ((1,), 1), ((2,), 2), ((5,), 60), ((10,), 2520)],
        ("range(2, n + 1)", "range(2, n)")),
    problem("is_prime", r"""
        import math

        def is_prime(n):
            if n < 2:
                return False
            for d in range(2, math.isqrt(n) + 1):
                if n % d == 0:
                    return False
            return True
        """,
        [((0,), False), ((1,), False), ((2,), True), ((9,), False), ((25,), False), ((97,), True)],
        ("math.isqrt(n) + 1", "math.isqrt(n)")),
    problem("primes_up_to", r"""
        def primes_up_to(n):
            if n < 2:
                return []
            sieve = [True] * (n + 1)
            sieve[0] = sieve[1] = False
            for i in range(2, int(n ** 0.5) + 1):
                if sieve[i]:
                    for j in range(i * i, n + 1, i):
                        sieve[j] = False
            return [i for i, flag in enumerate(sieve) if flag]
        """,
        [((n,), oracles.primes(n)) for n in (0, 1, 2, 10, 25, 30, 100)],
        ("range(i * i, n + 1, i)", "range(i * i, n, i)")),
    problem("digit_sum", r"""
        def digit_sum(n):
            return sum(int(c) for c in str(abs(n)))
        """,
        [((0,), 0), ((123,), 6), ((-45,), 9), ((9999,), 36), ((10 ** 20,), 1)],
        ("str(abs(n))", "str(n)")),
    problem("factorize", r"""
        def factorize(n):
            factors = []
            d = 2
            while d * d <= n:
                while n % d == 0:
                    factors.append(d)
                    n //= d
                d += 1
            if n > 1:
                factors.append(n)
            return factors
        """,
        [((1,), []), ((2,), [2]), ((12,), [2, 2, 3]), ((97,), [97]), ((360,), [2, 2, 2, 3, 3, 5]), ((49,), [7, 7])],
        ("d * d <= n", "d * d < n")),
    problem("collatz_steps", r"""
        def collatz_steps(n):
            steps = 0
            while n != 1:
                n = n // 2 if n % 2 == 0 else 3 * n + 1
                steps += 1
            return steps
        """,
        [((1,), 0), ((2,), 1), ((3,), 7), ((6,), 8), ((27,), 111)],
        ("steps = 0", "steps = 1")),
    problem("fibonacci", r"""
        def fibonacci(n):
            a, b = 0, 1
            for _ in range(n):
                a, b = b, a + b
            return a
        """,
        [((0,), 0), ((1,), 1), ((2,), 1), ((10,), 55), ((50,), 12586269025)],
        ("range(n)", "range(n - 1)")),
    problem("pascal_row", r"""
        def pascal_row(n):
            row = [1]
            for _ in range(n):
                row = [a + b for a, b in zip([0] + row, row + [0])]
            return row
        """,
        [((n,), oracles.pascal_row(n)) for n in (0, 1, 2, 4, 6, 15)],
        ("zip([0] + row, row + [0])", "zip([0] + row, row)")),
    problem("hypotenuse", r"""
        import math

        def hypotenuse(a, b):
            return round(math.sqrt(a * a + b * b), 3)
        """,
        [((3, 4), 5.0), ((5, 12), 13.0), ((1, 1), 1.414), ((0, 0), 0.0), ((8, 15), 17.0)],
        ("a * a + b * b", "a * a + b")),
    problem("circle_area", r"""
        import math

        def circle_area(r):
            return round(math.pi * r ** 2, 2)
        """,
        [((1,), 3.14), ((0,), 0.0), ((2,), 12.57), ((10,), 314.16), ((0.5,), 0.79)],
        ("r ** 2", "r * 2")),
    problem("is_perfect_square", r"""
        import math

        def is_perfect_square(n):
            if n < 0:
                return False
            root = math.isqrt(n)
            return root * root == n
        """,
        [((-1,), False), ((-4,), False), ((0,), True), ((1,), True), ((15,), False), ((16,), True),
         ((10 ** 20,), True)],
        ("if n < 0:", "if n < -1:")),
    problem("to_base", r"""
        import string

        DIGITS = string.digits + string.ascii_uppercase

        def to_base(n, base):
            if n == 0:
                return "0"
            sign = "-" if n < 0 else ""
            n = abs(n)
            out = []
            while n:
                n, r = divmod(n, base)
                out.append(DIGITS[r])
            return sign + "".join(reversed(out))
        """,
        [((0, 2), "0"), ((10, 2), "1010"), ((255, 16), "FF"), ((-35, 36), "-Z"), ((100, 7), "202")],
        ('return "0"', 'return ""')),
    problem("from_roman", r"""
        def from_roman(s):
            values = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
            total = 0
            for i, ch in enumerate(s):
                v = values[ch]
                if i + 1 < len(s) and values[s[i + 1]] > v:
                    total -= v
                else:
                    total += v
            return total
        """,
        [(("III",), 3), (("IV",), 4), (("IX",), 9), (("LVIII",), 58), (("MCMXCIV",), 1994), (("MMXXIV",), 2024)],
        ("values[s[i + 1]] > v", "values[s[i + 1]] >= v")),
    problem("to_roman", r"""
        def to_roman(n):
            table = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
                     (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]
            parts = []
            for value, numeral in table:
                count, n = divmod(n, value)
                parts.append(numeral * count)
            return "".join(parts)
        """,
        [((1,), "I"), ((4,), "IV"), ((14,), "XIV"), ((1994,), "MCMXCIV"), ((3999,), "MMMCMXCIX")],
        ('(900, "CM"), ', "")),
    problem("median", r"""
        def median(xs):
            s = sorted(xs)
            mid = len(s) // 2
            if len(s) % 2:
                return float(s[mid])
            return (s[mid - 1] + s[mid]) / 2
        """,
        [(([3, 1, 2],), 2.0), (([4, 1, 3, 2],), 2.5), (([5],), 5.0), (([1, 1, 1, 10],), 1.0), (([-3, -1],), -2.0)],
        ("(s[mid - 1] + s[mid]) / 2", "(s[mid] + s[mid + 1]) / 2")),
    problem("is_armstrong", r"""
        def is_armstrong(n):
            digits = [int(c) for c in str(n)]
            power = len(digits)
            return sum(d ** power for d in digits) == n
        """,
        [((153,), True), ((370,), True), ((9474,), True), ((10,), False), ((0,), True), ((100,), False)],
        ("power = len(digits)", "power = 3")),
    problem("count_divisors", r"""
        import math

        def count_divisors(n):
            count = 0
            for d in range(1, math.isqrt(n) + 1):
                if n % d == 0:
                    count += 1 if d * d == n else 2
            return count
        """,
        [((n,), oracles.divisor_count(n)) for n in (1, 12, 13, 16, 36, 360)],
        ("count += 1 if d * d == n else 2", "count += 2")),
    problem("quadratic_roots", r"""
        import math

        def quadratic_roots(a, b, c):
            disc = b * b - 4 * a * c
            if disc < 0:
                return []
            if disc == 0:
                return [-b / (2 * a)]
            root = math.sqrt(disc)
            return sorted([(-b - root) / (2 * a), (-b + root) / (2 * a)])
        """,
        [((1, -3, 2), [1.0, 2.0]), ((1, 2, 1), [-1.0]), ((1, 0, 1), []), ((1, 0, -4), [-2.0, 2.0]),
         ((2, -4, -6), [-1.0, 3.0])],
        ("b * b - 4 * a * c", "b * b + 4 * a * c")),
    problem("factorial_trailing_zeros", r"""
        def factorial_trailing_zeros(n):
            count = 0
            power = 5
            while power <= n:
                count += n // power
                power *= 5
            return count
        """,
        [((n,), oracles.factorial_trailing_zeros(n)) for n in (0, 4, 5, 25, 100, 1000)],
        ("while power <= n", "while power < n")),
    problem("sum_square_difference", r"""
        def sum_square_difference(n):
            total = n * (n + 1) // 2
            squares = sum(k * k for k in range(1, n + 1))
            return total * total - squares
        """,
        [((n,), oracles.square_difference(n)) for n in (0, 1, 2, 3, 10)],
        ("range(1, n + 1)", "range(1, n)")),
    problem("is_leap_year", r"""
        def is_leap_year(y):
            return y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)
        """,
        [((2000,), True), ((1900,), False), ((2024,), True), ((2023,), False), ((2100,), False), ((1600,), True)],
        (" or ", " and ")),
    problem("day_of_year", r"""
        def day_of_year(year, month, day):
            days = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
            if year % 4 == 0 and (year % 100 != 0 or year % 400 == 0):
                days[1] = 29
            return sum(days[:month - 1]) + day
        """,
        [(args, oracles.day_of_year(*args)) for args in
         ((2023, 1, 1), (2023, 3, 1), (2024, 3, 1), (2023, 12, 31), (2024, 12, 31), (1900, 3, 1))],
        ("days[:month - 1]", "days[:month]")),
    problem("digital_root", r"""
        def digital_root(n):
            while n >= 10:
                n = sum(int(c) for c in str(n))
            return n
        """,
        [((n,), oracles.digital_root(n)) for n in (0, 9, 10, 38, 493193, 10 ** 30)],
        ("n >= 10", "n > 10")),
    problem("polygon_area", r"""
        def polygon_area(points):
            total = 0
            n = len(points)
            for i in range(n):
                x1, y1 = points[i]
                x2, y2 = points[(i + 1) % n]
                total += x1 * y2 - x2 * y1
            return abs(total) / 2
        """,
        [(([(0, 0), (4, 0), (4, 3)],), 6.0), (([(0, 0), (2, 0), (2, 2), (0, 2)],), 4.0), (([],), 0.0),
         (([(0, 0), (0, 2), (2, 2), (2, 0)],), 4.0), (([(0, 0), (1, 0), (2, 0)],), 0.0)],
        ("abs(total) / 2", "total / 2")),
    problem("list_product", r"""
        import operator
        from functools import reduce

        def list_product(xs):
            return reduce(operator.mul, xs, 1)
        """,
        [(([1, 2, 3, 4],), 24), (([],), 1), (([0, 5],), 0), (([-2, 3],), -6), (([7],), 7)],
        ("xs, 1)", "xs, 0)")),
    problem("mean_of_evens", r"""
        def mean_of_evens(xs):
            evens = [x for x in xs if x % 2 == 0]
            if not evens:
                return None
            return sum(evens) / len(evens)
        """,
        [(([1, 2, 3, 4],), 3.0), (([],), None), (([1, 3],), None), (([0],), 0.0), (([-2, 4, 7, 10],), 4.0)],
        ("x % 2 == 0", "x % 2 == 1")),
]
