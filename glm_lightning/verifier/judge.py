"""Turn the bytes a sandbox child wrote (plus the zygote's exit report) into a Verdict. Runs in the trusted parent.

The child's output is treated as hostile input: it must be a well-formed, complete, in-order record stream
(see child.py) ending with the job's nonce, or the verdict is "error". Expected values live only here; comparison is
exact in value *and* type, recursively (`True` is not `1`, `1.0` is not `1`, a tuple is not a list).

Nothing a child sends can crash or stall the caller: the payload is capped (1 MiB) before it gets here, JSON nesting
is bounded by the decoder, dicts are never hashed by a child-chosen key (`protocol.Pairs`), huge ints are never
converted to decimal (`safe_repr`), every exception while judging becomes an "error" verdict, and `detail` is
bounded and printable (control, escape and other non-printable characters are escaped).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from . import protocol
from .verdict import Verdict

REPR_CHARS = 60
DETAIL_CHARS = 240
REPR_MAX_INT_BITS = 256  # larger ints are shown by size: decimal conversion is quadratic and capped by Python
SIGXCPU_EXIT = -24  # waitstatus_to_exitcode of a child killed by SIGXCPU (RLIMIT_CPU)
VIOLATION_EXIT = 77  # guards.EXIT_VIOLATION: the audit hook ended the process
RESOURCE_EXCEPTIONS = frozenset({"MemoryError"})


@dataclass(frozen=True)
class Reply:
    """What came back for one job: the zygote's header and the child's raw bytes, or an infrastructure error."""

    header: dict[str, Any] | None
    payload: bytes
    error: str | None = None
    sent_at: float = 0.0
    done_at: float = 0.0


class MalformedStream(ValueError):
    pass


def strict_equal(got: Any, expected: Any) -> bool:
    """Equality with identical types at every level (NaN equals NaN; dict keys must match type too)."""
    if type(got) is protocol.Pairs:
        return type(expected) is dict and _pairs_equal(got, expected)
    if type(got) is not type(expected):
        return False
    if type(got) is float:
        return got == expected or (math.isnan(got) and math.isnan(expected))
    if type(got) in (list, tuple):
        return len(got) == len(expected) and all(strict_equal(a, b) for a, b in zip(got, expected))
    if type(got) is dict:  # only trusted values are real dicts
        if len(got) != len(expected):
            return False
        got_by_key = {protocol.dumps(k): v for k, v in got.items()}
        for key, value in expected.items():
            tag = protocol.dumps(key)
            if tag not in got_by_key or not strict_equal(got_by_key[tag], value):
                return False
        return True
    if isinstance(got, protocol.Unsupported):
        return False
    return got == expected


def _pairs_equal(got: protocol.Pairs, expected: dict) -> bool:
    """Child dict vs expected dict, matched by canonical key text (str hashing is randomised: no collisions)."""
    if len(got) != len(expected):
        return False
    by_key = {text: value for text, _key, value in got.items}
    if len(by_key) != len(got):
        return False  # duplicate keys: not something a real dict produces
    for key, value in expected.items():
        text = protocol.dumps(key)
        if text not in by_key or not strict_equal(by_key[text], value):
            return False
    return True


class _Full(Exception):
    pass


def safe_repr(value: Any, limit: int = REPR_CHARS) -> str:
    """Bounded repr of a decoded value: never converts huge ints to decimal, never walks more than needed."""
    out: list[str] = []
    room = [limit + 1]

    def put(text: str) -> None:
        out.append(text)
        room[0] -= len(text)
        if room[0] < 0:
            raise _Full

    def walk(x: Any) -> None:
        t = type(x)
        if t is int:
            put(repr(x) if x.bit_length() <= REPR_MAX_INT_BITS else f"<int with {x.bit_length()} bits>")
        elif t in (bool, float) or x is None:
            put(repr(x))
        elif t in (str, bytes):
            put(repr(x[: limit + 1]))
        elif t in (list, tuple):
            put("[" if t is list else "(")
            for i, item in enumerate(x):
                if i:
                    put(", ")
                walk(item)
            put("]" if t is list else ("," if len(x) == 1 else "") + ")")
        elif t in (dict, protocol.Pairs):
            put("{")
            pairs = ((k, v) for _, k, v in x.items) if t is protocol.Pairs else x.items()
            for i, (k, v) in enumerate(pairs):
                if i:
                    put(", ")
                walk(k)
                put(": ")
                walk(v)
            put("}")
        elif t is protocol.Unsupported:
            put(f"<unsupported: {x.reason}>")
        else:
            put(f"<{t.__name__}>")

    try:
        walk(value)
    except _Full:
        pass
    except RecursionError:
        out.append("...")
    text = "".join(out)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def printable(text: str, limit: int = DETAIL_CHARS) -> str:
    """Escape every non-printable character (controls, ANSI escapes, bidi overrides...) and cap the length."""
    if text.isprintable() and len(text) <= limit:
        return text
    out = []
    size = 0
    for char in text:
        piece = char if char.isprintable() else (f"\\x{ord(char):02x}" if ord(char) < 0x100 else
                                                 f"\\u{ord(char):04x}" if ord(char) < 0x10000 else
                                                 f"\\U{ord(char):08x}")
        out.append(piece)
        size += len(piece)
        if size > limit:
            break
    result = "".join(out)
    return result if len(result) <= limit else result[: limit - 3] + "..."


def _short(value: Any) -> str:
    return safe_repr(value)


def _tagged_str(tagged: Any) -> str:
    value = protocol.decode(tagged, untrusted=True)
    if type(value) is not str:
        raise MalformedStream("expected a string")
    return value


@dataclass
class _Stream:
    """Parsed record stream."""

    started: bool = False
    invalid: str | None = None
    crash: str | None = None
    violation: str | None = None
    results: list[tuple[str, Any]] | None = None  # ("v", value) or ("x", exception name), in test order
    ended: bool = False


def parse_stream(payload: bytes, nonce: str, total: int) -> _Stream:
    """Strictly parse the child's records; raises MalformedStream on anything unexpected."""
    stream = _Stream(results=[])
    assert stream.results is not None
    if payload and not payload.endswith(b"\n"):
        raise MalformedStream("incomplete last record")
    for raw in payload.split(b"\n")[:-1] if payload else []:
        if stream.ended:
            raise MalformedStream("data after the end record")
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError):
            raise MalformedStream("not JSON") from None
        if type(record) is not list or not record or type(record[0]) is not str:
            raise MalformedStream("not a record")
        kind, n = record[0], len(record)
        if not stream.started:
            if kind != "t" or n != 2:
                raise MalformedStream("missing start record")
            stream.started = True
        elif kind in ("v", "x") and n == 3 and stream.invalid is None and stream.crash is None \
                and stream.violation is None:
            if type(record[1]) is not int or record[1] != len(stream.results) or record[1] >= total:
                raise MalformedStream("test results out of order")
            if kind == "v":
                stream.results.append(("v", protocol.decode_result(record[2])))
            else:
                stream.results.append(("x", _tagged_str(record[2])))
        elif kind == "invalid" and n == 2 and not stream.results and stream.invalid is None and stream.crash is None:
            stream.invalid = _tagged_str(record[1])
        elif kind == "crash" and n == 2 and not stream.results and stream.invalid is None and stream.crash is None:
            stream.crash = _tagged_str(record[1])
        elif kind == "viol" and n == 2 and stream.violation is None:
            stream.violation = _tagged_str(record[1])
        elif kind == "end" and n == 4:
            if record[1] != nonce:
                raise MalformedStream("wrong nonce in end record")
            if type(record[2]) is not int or record[2] != len(stream.results):
                raise MalformedStream("end record count mismatch")
            stream.ended = True
        else:
            raise MalformedStream(f"unexpected record {kind!r}")
    return stream


def judge(reply: Reply, nonce: str, entry_point: str, tests: list[tuple[tuple, Any]], timeout_s: float) -> Verdict:
    """Classify one reply. Exit status alone never counts as success; nothing in the reply can make this raise."""
    try:
        return _judge(reply, nonce, entry_point, tests, timeout_s)
    except Exception as exc:  # a bug or an input we did not foresee: never crash the trainer over one candidate
        return Verdict("error", 0, len(tests), printable(f"could not judge the result ({type(exc).__name__})"))


def _violation_reason(payload: bytes) -> str:
    """The guard's ["viol", ...] record, if it made it into the pipe (best effort: the exit status decides)."""
    for raw in reversed(payload[-4096:].split(b"\n")):
        if raw.startswith(b'["viol",'):
            try:
                return _tagged_str(json.loads(raw)[1])
            except (ValueError, IndexError, MalformedStream, protocol.DecodeError, RecursionError):
                break
    return "unknown operation"


def _judge(reply: Reply, nonce: str, entry_point: str, tests: list[tuple[tuple, Any]], timeout_s: float) -> Verdict:
    total = len(tests)
    elapsed = max(0.0, reply.done_at - reply.sent_at)

    def verdict(status: str, passed: int, detail: str) -> Verdict:
        return Verdict(status, passed, total, printable(detail), elapsed)  # type: ignore[arg-type]

    if reply.error is not None or reply.header is None:
        return verdict("error", 0, f"sandbox failure: {reply.error or 'no reply'}")
    header = reply.header
    if header.get("exit") == VIOLATION_EXIT and not header.get("timed_out"):
        return verdict("error", 0, f"forbidden operation: {_violation_reason(reply.payload)}")
    if header.get("cleanup_ok") is False:
        return verdict("error", 0, "sandbox cleanup failed (the server was restarted)")
    if header.get("truncated"):
        return verdict("error", 0, "result too large (output cap exceeded)")
    try:
        stream = parse_stream(reply.payload, nonce, total)
    except (MalformedStream, protocol.DecodeError) as exc:
        if header.get("timed_out"):
            return verdict("timeout", 0, f"timed out after {timeout_s:g} s")
        return verdict("error", 0, f"malformed result stream ({exc})")

    results = stream.results or []
    passes = [kind == "v" and strict_equal(value, expected)
              for (kind, value), (_, expected) in zip(results, tests)]
    passed = sum(passes)
    exit_code = header.get("exit")
    if header.get("timed_out") or (not stream.ended and exit_code == SIGXCPU_EXIT):
        why = "timed out" if header.get("timed_out") else "CPU time limit exceeded"
        return verdict("timeout", passed, f"{why} after {timeout_s:g} s ({len(results)} of {total} tests ran)")
    if not stream.ended:
        how = f"killed by signal {-exit_code}" if isinstance(exit_code, int) and exit_code < 0 else \
            f"exit code {exit_code}"
        return verdict("error", passed, f"sandbox exited without a complete result ({how})")
    if stream.violation is not None:
        return verdict("error", passed, f"forbidden operation: {stream.violation}")
    if stream.invalid is not None:
        return verdict("invalid", 0, stream.invalid)
    if stream.crash is not None:
        return verdict("error", 0, f"crashed while loading the module: {stream.crash}")
    if len(results) != total:
        return verdict("error", passed, f"only {len(results)} of {total} tests ran")
    for kind, value in results:
        if kind == "x" and value in RESOURCE_EXCEPTIONS:
            return verdict("error", passed, f"resource limit exceeded ({value})")
    if passed == total:
        return verdict("passed", passed, f"all {total} tests passed")
    index = passes.index(False)
    (kind, value), (args, expected) = results[index], tests[index]
    call = f"{entry_point}{_short(args) if len(args) != 1 else '(' + _short(args[0]) + ')'}"
    if kind == "x":
        first = f"{call} raised {value}"
    elif isinstance(value, protocol.Unsupported):
        first = f"{call} returned an unsupported value ({value.reason}), expected {_short(expected)}"
    else:
        first = f"{call} returned {_short(value)}, expected {_short(expected)}"
    return verdict("failed", passed, f"{passed}/{total} passed; first failure: {first}")
