"""Text problems: parsing, formatting and validation (with `re` and `string`)."""

from __future__ import annotations

from . import oracles
from .problem import problem

PROBLEMS = [
    problem("is_pangram", r"""
        import string

        def is_pangram(text):
            return set(string.ascii_lowercase) <= set(text.lower())
        """,
        [(("The quick brown fox jumps over the lazy dog",), True), (("",), False),
         (("ABCDEFGHIJKLMNOPQRSTUVWXYZ",), True), (("abcdefghijklmnopqrstuvwxy",), False),
         (("Pack my box with five dozen liquor jugs",), True)],
        ("set(text.lower())", "set(text)")),
    problem("caesar", r"""
        import string

        def caesar(text, shift):
            lower, upper = string.ascii_lowercase, string.ascii_uppercase
            k = shift % 26
            table = str.maketrans(lower + upper, lower[k:] + lower[:k] + upper[k:] + upper[:k])
            return text.translate(table)
        """,
        [(("abc", 1), "bcd"), (("xyz", 3), "abc"), (("Hello, World!", 13), "Uryyb, Jbeyq!"), (("abc", -1), "zab"),
         (("", 5), "")],
        ("k = shift % 26", "k = shift % 25")),
    problem("top_words", r"""
        import re
        from collections import Counter

        def top_words(text, k):
            words = re.findall(r"[a-z']+", text.lower())
            return [w for w, _ in Counter(words).most_common(k)]
        """,
        [(("the cat and the hat", 1), ["the"]), (("a b b c c c", 2), ["c", "b"]), (("", 3), []),
         (("Dog dog DOG cat", 2), ["dog", "cat"]), (("x y z", 5), ["x", "y", "z"])],
        ("text.lower()", "text")),
    problem("is_identifier", r"""
        import re

        def is_identifier(s):
            return re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", s) is not None
        """,
        [(("abc",), True), (("_x1",), True), (("1abc",), False), (("",), False), (("a-b",), False), (("A",), True)],
        ("[A-Za-z0-9_]*", "[A-Za-z0-9_-]*")),
    problem("extract_numbers", r"""
        import re

        def extract_numbers(text):
            return [int(m) for m in re.findall(r"-?\d+", text)]
        """,
        [(("a1b22c333",), [1, 22, 333]), (("",), []), (("temp -5 to 10",), [-5, 10]), (("no digits",), []),
         (("007 and 8",), [7, 8])],
        (r"-?\d+", r"-?\d")),
    problem("snake_to_camel", r"""
        def snake_to_camel(name):
            head, *rest = name.split("_")
            return head + "".join(part.capitalize() for part in rest)
        """,
        [(("hello_world",), "helloWorld"), (("a",), "a"), (("get_http_response",), "getHttpResponse"), (("",), ""),
         (("x_y_z",), "xYZ")],
        ("return head + ", "return head.capitalize() + ")),
    problem("camel_to_snake", r"""
        import re

        def camel_to_snake(name):
            return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
        """,
        [(("helloWorld",), "hello_world"), (("HelloWorld",), "hello_world"), (("x",), "x"), (("",), ""),
         (("getHTTP",), "get_h_t_t_p")],
        ("(?<!^)", "")),
    problem("run_length_encode", r"""
        from itertools import groupby

        def run_length_encode(s):
            return "".join(f"{len(list(group))}{ch}" for ch, group in groupby(s))
        """,
        [(("aaabcc",), "3a1b2c"), (("",), ""), (("a",), "1a"), (("abab",), "1a1b1a1b"), (("z" * 12,), "12z")],
        ("groupby(s)", "groupby(sorted(s))")),
    problem("run_length_decode", r"""
        import re

        def run_length_decode(s):
            return "".join(ch * int(count) for count, ch in re.findall(r"(\d+)(\D)", s))
        """,
        [(("3a1b2c",), "aaabcc"), (("",), ""), (("12z",), "z" * 12), (("1a1b",), "ab"), (("10x2y",), "x" * 10 + "yy")],
        (r"(\d+)(\D)", r"(\d)(\D)")),
    problem("is_anagram", r"""
        def is_anagram(a, b):
            clean = lambda s: sorted(s.replace(" ", "").lower())
            return clean(a) == clean(b)
        """,
        [(("listen", "silent"), True), (("Dormitory", "dirty room"), True), (("abc", "abd"), False), (("", ""), True),
         (("aab", "abb"), False)],
        ("sorted(", "set(")),
    problem("longest_common_prefix", r"""
        def longest_common_prefix(words):
            if not words:
                return ""
            prefix = words[0]
            for w in words[1:]:
                while not w.startswith(prefix):
                    prefix = prefix[:-1]
            return prefix
        """,
        [((["flower", "flow", "flight"],), "fl"), ((["dog", "racecar", "car"],), ""), (([],), ""),
         ((["same"],), "same"), ((["ab", "abc"],), "ab")],
        ("if not words:", "if words is None:")),
    problem("reverse_words", r"""
        def reverse_words(s):
            return " ".join(reversed(s.split()))
        """,
        [(("hello world",), "world hello"), (("  a  b ",), "b a"), (("",), ""), (("one",), "one"),
         (("a b c",), "c b a")],
        ("s.split()", 's.split(" ")')),
    problem("title_case", r"""
        def title_case(text, minor):
            words = text.lower().split()
            return " ".join(w if w in minor and i > 0 else w.capitalize() for i, w in enumerate(words))
        """,
        [(("the lord of the rings", ["of", "the"]), "The Lord of the Rings"), (("", []), ""),
         (("a tale", ["a"]), "A Tale"), (("HELLO", []), "Hello"), (("war AND peace", ["and"]), "War and Peace")],
        ("i > 0", "i >= 0")),
    problem("count_overlapping", r"""
        def count_overlapping(text, sub):
            count = start = 0
            while True:
                idx = text.find(sub, start)
                if idx == -1:
                    return count
                count += 1
                start = idx + 1
        """,
        [(args, oracles.overlapping_count(*args)) for args in
         (("aaaa", "aa"), ("abc", "d"), ("abababa", "aba"), ("", "a"), ("banana", "ana"))],
        ("start = idx + 1", "start = idx + len(sub)")),
    problem("squeeze_spaces", r"""
        import re

        def squeeze_spaces(s):
            return re.sub(r"\s+", " ", s).strip()
        """,
        [(("a  b\t\nc",), "a b c"), (("   ",), ""), (("x",), "x"), ((" lead trail ",), "lead trail"), (("",), "")],
        (").strip()", ")")),
    problem("is_email", r"""
        import re

        EMAIL = re.compile(r"^[\w.+-]+@[\w-]+(\.[\w-]+)+$")

        def is_email(s):
            return EMAIL.match(s) is not None
        """,
        [(("a@b.com",), True), (("first.last+tag@mail.example.org",), True), (("no-at-sign.com",), False),
         (("a@b",), False), (("@b.com",), False), (("a@b.c om",), False)],
        (r"(\.[\w-]+)+$", r"(\.[\w-]+)*$")),
    problem("parse_key_values", r"""
        import re

        def parse_key_values(text):
            return {k: v for k, v in re.findall(r"(\w+)=(\w*)", text)}
        """,
        [(("a=1 b=2",), {"a": "1", "b": "2"}), (("",), {}), (("x= y=z",), {"x": "", "y": "z"}),
         (("k=v k=w",), {"k": "w"}), (("junk",), {})],
        (r"(\w+)=(\w*)", r"(\w+)=(\w+)")),
    problem("letter_counts", r"""
        import string

        def letter_counts(text):
            counts = {}
            for ch in text.lower():
                if ch in string.ascii_lowercase:
                    counts[ch] = counts.get(ch, 0) + 1
            return counts
        """,
        [(("Hello",), {"h": 1, "e": 1, "l": 2, "o": 1}), (("",), {}), (("123!",), {}), (("AaBb",), {"a": 2, "b": 2}),
         (("zz z",), {"z": 3})],
        ("text.lower()", "text")),
    problem("strip_punctuation", r"""
        import string

        def strip_punctuation(text):
            return text.translate(str.maketrans("", "", string.punctuation))
        """,
        [(("Hello, world!",), "Hello world"), (("",), ""), (("a.b.c",), "abc"), (("no punct",), "no punct"),
         (("'quoted'",), "quoted")],
        ("string.punctuation", '".,!?"')),
    problem("is_palindrome_sentence", r"""
        import re

        def is_palindrome_sentence(s):
            cleaned = re.sub(r"[^a-z0-9]", "", s.lower())
            return cleaned == cleaned[::-1]
        """,
        [(("A man, a plan, a canal: Panama",), True), (("race a car",), False), (("",), True),
         (("No 'x' in Nixon",), True), (("ab",), False)],
        ("s.lower()", "s")),
    problem("wrap_text", r"""
        def wrap_text(text, width):
            lines, current = [], ""
            for word in text.split():
                if current and len(current) + 1 + len(word) > width:
                    lines.append(current)
                    current = word
                else:
                    current = f"{current} {word}" if current else word
            if current:
                lines.append(current)
            return lines
        """,
        [(("the quick brown fox", 10), ["the quick", "brown fox"]), (("", 5), []), (("a b c", 1), ["a", "b", "c"]),
         (("hello", 3), ["hello"]), (("aa bb cc", 5), ["aa bb", "cc"])],
        ("> width", ">= width")),
    problem("mask_card", r"""
        import re

        def mask_card(number):
            digits = re.sub(r"\D", "", number)
            return "*" * (len(digits) - 4) + digits[-4:]
        """,
        [(("1234 5678 9012 3456",), "************3456"), (("1234",), "1234"), (("12-34-56",), "**3456"),
         (("12",), "12"), (("",), "")],
        ("digits[-4:]", "digits[-3:]")),
    problem("fill_template", r"""
        from string import Template

        def fill_template(text, values):
            return Template(text).safe_substitute(values)
        """,
        [(("Hello $name", {"name": "Ann"}), "Hello Ann"), (("$a+$b", {"a": "1"}), "1+$b"), (("", {}), ""),
         (("${x}y", {"x": "z"}), "zy"), (("cost: $$5", {}), "cost: $5")],
        ("safe_substitute", "substitute")),
    problem("capitalize_sentences", r"""
        import re

        def capitalize_sentences(text):
            return re.sub(r"(^|[.!?]\s+)([a-z])", lambda m: m.group(1) + m.group(2).upper(), text)
        """,
        [(("hello. how are you? fine!",), "Hello. How are you? Fine!"), (("",), ""), (("a",), "A"),
         (("already Fine. ok",), "Already Fine. Ok"), (("x.y",), "X.y")],
        ("[.!?]", "[.!]")),
    problem("is_hex", r"""
        import string

        def is_hex(s):
            return bool(s) and all(c in string.hexdigits for c in s)
        """,
        [(("ff",), True), (("DEADbeef",), True), (("",), False), (("0x1f",), False), (("g",), False), (("123",), True)],
        ("bool(s) and ", "")),
    problem("vowel_positions", r"""
        def vowel_positions(word):
            return [i for i, ch in enumerate(word) if ch.lower() in "aeiou"]
        """,
        [(("banana",), [1, 3, 5]), (("",), []), (("rhythm",), []), (("AEIOU",), [0, 1, 2, 3, 4]),
         (("Apple",), [0, 4])],
        ("ch.lower()", "ch")),
    problem("split_sentences", r"""
        import re

        def split_sentences(text):
            return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]
        """,
        [(("Hi. How are you? Fine!",), ["Hi.", "How are you?", "Fine!"]), (("",), []), (("One only",), ["One only"]),
         ((" A.  B. ",), ["A.", "B."]), (("Wait... what?",), ["Wait...", "what?"])],
        (r"(?<=[.!?])\s+", r"(?<=[.!])\s+")),
]
