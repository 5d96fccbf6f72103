"""Problems solved with small classes the function uses: plain classes, dataclasses, inheritance, dunder methods."""

from __future__ import annotations

from . import oracles
from .problem import problem

PROBLEMS = [
    problem("balanced", r"""
        class Stack:
            def __init__(self):
                self._items = []

            def push(self, x):
                self._items.append(x)

            def pop(self):
                return self._items.pop()

            def empty(self):
                return not self._items


        def balanced(s):
            pairs = {")": "(", "]": "[", "}": "{"}
            stack = Stack()
            for ch in s:
                if ch in "([{":
                    stack.push(ch)
                elif ch in pairs:
                    if stack.empty() or stack.pop() != pairs[ch]:
                        return False
            return stack.empty()
        """,
        [(("()[]{}",), True), (("([)]",), False), (("",), True), (("((",), False), (("{[()]}x",), True),
         ((")",), False)],
        ("return stack.empty()", "return True")),
    problem("run_queue", r"""
        class TwoStackQueue:
            def __init__(self):
                self.inbox, self.outbox = [], []

            def put(self, x):
                self.inbox.append(x)

            def get(self):
                if not self.outbox:
                    while self.inbox:
                        self.outbox.append(self.inbox.pop())
                return self.outbox.pop()


        def run_queue(ops):
            q = TwoStackQueue()
            out = []
            for op in ops:
                if op == "get":
                    out.append(q.get())
                else:
                    q.put(op)
            return out
        """,
        [(([1, 2, "get", 3, "get", "get"],), [1, 2, 3]), (([],), []), (([5, "get"],), [5]),
         (([1, 2, 3, "get", 4, "get", "get", "get"],), [1, 2, 3, 4])],
        ("if not self.outbox:", "if True:")),
    problem("farthest_from_origin", r"""
        import math
        from dataclasses import dataclass


        @dataclass(frozen=True)
        class Point:
            x: float
            y: float

            def dist(self, other):
                return math.hypot(self.x - other.x, self.y - other.y)


        def farthest_from_origin(coords):
            origin = Point(0, 0)
            points = [Point(x, y) for x, y in coords]
            best = max(points, key=origin.dist)
            return (best.x, best.y)
        """,
        [(([(1, 1), (3, 4), (-5, 0)],), (3, 4)), (([(0, 0)],), (0, 0)), (([(2, 2), (-3, 0)],), (-3, 0)),
         (([(1, 0), (0, -2)],), (0, -2))],
        ("max(points", "min(points")),
    problem("final_balance", r"""
        class InsufficientFunds(Exception):
            pass


        class Account:
            def __init__(self, balance=0):
                self.balance = balance

            def deposit(self, amount):
                if amount <= 0:
                    raise ValueError("deposit must be positive")
                self.balance += amount

            def withdraw(self, amount):
                if amount > self.balance:
                    raise InsufficientFunds(amount)
                self.balance -= amount


        def final_balance(ops):
            acct = Account()
            rejected = 0
            for kind, amount in ops:
                try:
                    getattr(acct, kind)(amount)
                except (ValueError, InsufficientFunds):
                    rejected += 1
            return [acct.balance, rejected]
        """,
        [(([("deposit", 100), ("withdraw", 30)],), [70, 0]), (([],), [0, 0]), (([("withdraw", 1)],), [0, 1]),
         (([("deposit", -5), ("deposit", 5), ("withdraw", 5)],), [0, 1]),
         (([("deposit", 10), ("withdraw", 10), ("withdraw", 1)],), [0, 1])],
        ("amount > self.balance", "amount >= self.balance")),
    problem("vector_ops", r"""
        class Vector:
            def __init__(self, *coords):
                self.coords = tuple(coords)

            def __add__(self, other):
                return Vector(*(a + b for a, b in zip(self.coords, other.coords)))

            def __mul__(self, k):
                return Vector(*(a * k for a in self.coords))

            def dot(self, other):
                return sum(a * b for a, b in zip(self.coords, other.coords))


        def vector_ops(a, b, k):
            u, v = Vector(*a), Vector(*b)
            return [list((u + v).coords), list((u * k).coords), u.dot(v)]
        """,
        [(([1, 2], [3, 4], 2), [[4, 6], [2, 4], 11]), (([], [], 5), [[], [], 0]),
         (([1, 0, -1], [1, 1, 1], 0), [[2, 1, 0], [0, 0, 0], 0]), (([2], [3], -1), [[5], [-2], 6])],
        ("a * k", "a + k")),
    problem("lru_simulate", r"""
        from collections import OrderedDict


        class LRUCache:
            def __init__(self, capacity):
                self.capacity = capacity
                self.data = OrderedDict()

            def get(self, key):
                if key not in self.data:
                    return -1
                self.data.move_to_end(key)
                return self.data[key]

            def put(self, key, value):
                self.data[key] = value
                self.data.move_to_end(key)
                if len(self.data) > self.capacity:
                    self.data.popitem(last=False)


        def lru_simulate(capacity, ops):
            cache = LRUCache(capacity)
            out = []
            for op in ops:
                if op[0] == "get":
                    out.append(cache.get(op[1]))
                else:
                    cache.put(op[1], op[2])
            return out
        """,
        [((2, [["put", 1, 1], ["put", 2, 2], ["get", 1], ["put", 3, 3], ["get", 2], ["put", 4, 4], ["get", 1],
               ["get", 3], ["get", 4]]), [1, -1, -1, 3, 4]),
         ((1, [["get", 1]]), [-1]), ((1, [["put", 1, 1], ["put", 1, 2], ["get", 1]]), [2]),
         ((2, [["put", 1, 1], ["put", 2, 2], ["put", 3, 3], ["get", 1], ["get", 3]]), [-1, 3])],
        ("popitem(last=False)", "popitem()")),
    problem("rank_employees", r"""
        from dataclasses import dataclass, field


        @dataclass(order=True)
        class Employee:
            sort_key: tuple = field(init=False, repr=False)
            name: str
            salary: int

            def __post_init__(self):
                self.sort_key = (-self.salary, self.name)


        def rank_employees(rows):
            staff = sorted(Employee(name, salary) for name, salary in rows)
            return [e.name for e in staff]
        """,
        [(([("ann", 10), ("bob", 20)],), ["bob", "ann"]), (([],), []), (([("b", 5), ("a", 5)],), ["a", "b"]),
         (([("x", 1), ("y", 3), ("z", 2)],), ["y", "z", "x"])],
        ("(-self.salary, self.name)", "(self.salary, self.name)")),
    problem("inventory_after", r"""
        class Inventory:
            def __init__(self):
                self._stock = {}

            def add(self, item, qty):
                self._stock[item] = self._stock.get(item, 0) + qty

            def remove(self, item, qty):
                have = self._stock.get(item, 0)
                if qty > have:
                    return False
                if qty == have:
                    del self._stock[item]
                else:
                    self._stock[item] = have - qty
                return True

            @property
            def items(self):
                return sorted(self._stock.items())


        def inventory_after(ops):
            inv = Inventory()
            removals = []
            for op, item, qty in ops:
                if op == "add":
                    inv.add(item, qty)
                else:
                    removals.append(inv.remove(item, qty))
            return [removals, [list(pair) for pair in inv.items]]
        """,
        [(([("add", "apple", 3), ("remove", "apple", 1)],), [[True], [["apple", 2]]]), (([],), [[], []]),
         (([("remove", "x", 1)],), [[False], []]),
         (([("add", "a", 2), ("remove", "a", 2), ("add", "b", 1)],), [[True], [["b", 1]]]),
         (([("add", "a", 1), ("add", "a", 1), ("remove", "a", 3)],), [[False], [["a", 2]]])],
        ("del self._stock[item]", "self._stock[item] = 0")),
    problem("sum_fractions", r"""
        import math


        class Ratio:
            def __init__(self, num, den):
                if den < 0:
                    num, den = -num, -den
                g = math.gcd(num, den) or 1
                self.num, self.den = num // g, den // g

            def __add__(self, other):
                return Ratio(self.num * other.den + other.num * self.den, self.den * other.den)


        def sum_fractions(pairs):
            total = Ratio(0, 1)
            for n, d in pairs:
                total = total + Ratio(n, d)
            return (total.num, total.den)
        """,
        [((pairs,), oracles.fraction_sum(pairs)) for pairs in
         ([(1, 2), (1, 3)], [], [(1, -2), (1, 2)], [(2, 4)], [(1, 6), (1, 3), (1, 2)], [(-3, 4), (5, -6)])],
        ("other.num * self.den", "other.num * other.den")),
    problem("graph_distance", r"""
        from collections import deque


        class Graph:
            def __init__(self, edges):
                self.adj = {}
                for a, b in edges:
                    self.adj.setdefault(a, []).append(b)
                    self.adj.setdefault(b, []).append(a)

            def distance(self, start, goal):
                seen = {start}
                queue = deque([(start, 0)])
                while queue:
                    node, d = queue.popleft()
                    if node == goal:
                        return d
                    for nxt in self.adj.get(node, []):
                        if nxt not in seen:
                            seen.add(nxt)
                            queue.append((nxt, d + 1))
                return -1


        def graph_distance(edges, start, goal):
            return Graph(edges).distance(start, goal)
        """,
        [(([[1, 2], [2, 3], [3, 4]], 1, 4), 3), (([], 1, 1), 0), (([[1, 2]], 1, 3), -1),
         (([[1, 2], [2, 3], [1, 3]], 1, 3), 1), (([["a", "b"], ["b", "c"]], "c", "a"), 2)],
        ("\n            self.adj.setdefault(b, []).append(a)", "")),
    problem("total_area", r"""
        import math


        class Shape:
            def area(self):
                raise NotImplementedError


        class Circle(Shape):
            def __init__(self, r):
                self.r = r

            def area(self):
                return math.pi * self.r ** 2


        class Rect(Shape):
            def __init__(self, w, h):
                self.w, self.h = w, h

            def area(self):
                return self.w * self.h


        class Square(Rect):
            def __init__(self, side):
                super().__init__(side, side)


        def total_area(specs):
            makers = {"circle": Circle, "rect": Rect, "square": Square}
            return round(sum(makers[kind](*dims).area() for kind, *dims in specs), 2)
        """,
        [(([["circle", 1]],), 3.14), (([],), 0), (([["rect", 2, 3], ["square", 2]],), 10),
         (([["circle", 2], ["square", 1]],), 13.57), (([["square", 3]],), 9)],
        ("super().__init__(side, side)", "super().__init__(side, 1)")),
    problem("countdown_list", r"""
        class Countdown:
            def __init__(self, start):
                self.start = start

            def __iter__(self):
                n = self.start
                while n > 0:
                    yield n
                    n -= 1


        def countdown_list(n):
            return list(Countdown(n))
        """,
        [((3,), [3, 2, 1]), ((0,), []), ((1,), [1]), ((-2,), []), ((5,), [5, 4, 3, 2, 1])],
        ("n > 0", "n >= 0")),
    problem("light_after", r"""
        from enum import Enum


        class Light(Enum):
            RED = "red"
            GREEN = "green"
            YELLOW = "yellow"

            def next(self):
                order = [Light.GREEN, Light.YELLOW, Light.RED]
                return order[(order.index(self) + 1) % len(order)]


        def light_after(start, steps):
            light = Light(start)
            for _ in range(steps):
                light = light.next()
            return light.value
        """,
        [(("red", 1), "green"), (("green", 0), "green"), (("yellow", 1), "red"), (("green", 4), "yellow"),
         (("red", 3), "red")],
        ("% len(order)", "% (len(order) - 1)")),
    problem("count_overlapping_pairs", r"""
        from typing import NamedTuple


        class Interval(NamedTuple):
            start: int
            end: int

            def overlaps(self, other):
                return self.start < other.end and other.start < self.end


        def count_overlapping_pairs(pairs):
            items = [Interval(*p) for p in pairs]
            return sum(1 for i in range(len(items)) for j in range(i + 1, len(items)) if items[i].overlaps(items[j]))
        """,
        [(([(1, 3), (2, 4), (5, 6)],), 1), (([],), 0), (([(1, 2), (2, 3)],), 0), (([(0, 10), (1, 2), (3, 4)],), 2),
         (([(1, 5), (1, 5)],), 1)],
        ("other.start < self.end", "other.start <= self.end")),
    problem("evaluate", r"""
        import re


        class Parser:
            def __init__(self, text):
                self.tokens = re.findall(r"\d+|[-+*/()]", text)
                self.pos = 0

            def peek(self):
                return self.tokens[self.pos] if self.pos < len(self.tokens) else None

            def take(self):
                tok = self.tokens[self.pos]
                self.pos += 1
                return tok

            def expr(self):
                value = self.term()
                while self.peek() in ("+", "-"):
                    if self.take() == "+":
                        value += self.term()
                    else:
                        value -= self.term()
                return value

            def term(self):
                value = self.factor()
                while self.peek() in ("*", "/"):
                    if self.take() == "*":
                        value *= self.factor()
                    else:
                        value //= self.factor()
                return value

            def factor(self):
                tok = self.take()
                if tok == "(":
                    value = self.expr()
                    self.take()
                    return value
                if tok == "-":
                    return -self.factor()
                return int(tok)


        def evaluate(text):
            return Parser(text).expr()
        """,
        [(("1+2*3",), 7), (("(1+2)*3",), 9), (("10/3",), 3), (("2-3-4",), -5), (("-(2+3)*2",), -10), (("42",), 42),
         (("2*3*4",), 24)],
        ('while self.peek() in ("*", "/")', 'if self.peek() in ("*", "/")')),
    problem("grid_cells", r"""
        class Range2D:
            def __init__(self, rows, cols):
                self.rows, self.cols = rows, cols
                self.i = 0

            def __iter__(self):
                return self

            def __next__(self):
                if self.i >= self.rows * self.cols:
                    raise StopIteration
                r, c = divmod(self.i, self.cols)
                self.i += 1
                return (r, c)


        def grid_cells(rows, cols):
            return list(Range2D(rows, cols))
        """,
        [((r, c), [(i, j) for i in range(r) for j in range(c)]) for r, c in ((2, 2), (0, 3), (1, 3), (3, 1), (2, 3))],
        ("divmod(self.i, self.cols)", "divmod(self.i, self.rows)")),
    problem("matrix_trace_power", r"""
        class Matrix:
            def __init__(self, rows):
                self.rows = [list(r) for r in rows]

            def __matmul__(self, other):
                cols = list(zip(*other.rows))
                return Matrix([[sum(a * b for a, b in zip(row, col)) for col in cols] for row in self.rows])

            @classmethod
            def identity(cls, n):
                return cls([[int(i == j) for j in range(n)] for i in range(n)])

            def trace(self):
                return sum(self.rows[i][i] for i in range(len(self.rows)))


        def matrix_trace_power(rows, k):
            m = Matrix(rows)
            result = Matrix.identity(len(rows))
            for _ in range(k):
                result = result @ m
            return result.trace()
        """,
        [(([[1, 1], [1, 0]], 5), 11), (([[2]], 0), 1), (([[2]], 3), 8), (([[0, 1], [1, 0]], 2), 2),
         (([[1, 2], [3, 4]], 1), 5)],
        ("int(i == j)", "int(i <= j)")),
]
