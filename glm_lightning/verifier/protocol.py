"""Type-tagged JSON: how test inputs travel to the sandbox and how return values travel back.

Plain JSON cannot tell `True` from `1`, `1.0` from `1` or a tuple from a list, and the verifier compares with exact
types, so every value is wrapped in a tag:

    None -> ["n"]            bool  -> ["b", 0|1]          int -> ["i", "<hex>"]       float -> ["f", "<repr>"]
    str  -> ["s", "<hex>"]   bytes -> ["y", "<hex>"]      list -> ["l", [...]]        tuple -> ["t", [...]]
    dict -> ["d", [[k, v], ...]]                          anything else (sandbox side only) -> ["u", "<hex name>"]

Strings and bytes are hex-encoded (UTF-8 with surrogatepass for str), so the produced text is plain ASCII and never
needs escaping; ints are hex so that huge ints are not hit by the int-to-decimal digit limit.

This file is imported both by the trusted parent and inside the sandbox child (as a top-level module), so it uses the
standard library only. `make_encoder` binds every primitive it needs when it is *created*: the child creates its
encoder before candidate code runs, so candidate code that later patches `builtins`, `json` or this module's globals
does not change how results are serialised. Only exact built-in types are accepted (`type(x) is int`), so an `int`
subclass with a patched `__eq__`, or an object whose `__eq__` always returns True, is reported as unsupported.
"""

from __future__ import annotations

import json
from typing import Any, Callable

MAX_DEPTH = 32
MAX_NODES = 100_000
MAX_TEXT_BYTES = 256 * 1024  # total str/bytes payload in one encoded value

SUPPORTED_TYPES = "None, bool, int, float, str, bytes, list, tuple, dict"


class EncodeError(TypeError):
    """The value (or something inside it) cannot be represented in the tagged format."""


class DecodeError(ValueError):
    """A tagged message is malformed (a protocol violation, possibly from a hostile candidate)."""


def make_encoder(strict: bool) -> Callable[[Any], str]:
    """Return `encode(value) -> JSON text` built from primitives captured now.

    strict=True (parent): unsupported values raise EncodeError.
    strict=False (sandbox child): unsupported values become ["u", name] and never raise.
    """
    _type = type
    _NoneType = type(None)
    _bool, _int, _float, _str, _bytes = bool, int, float, str, bytes
    _list, _tuple, _dict = list, tuple, dict
    _hex = bytes.hex
    _str_encode = str.encode
    _int_format = int.__format__
    _float_repr = float.__repr__
    _dict_items = dict.items
    _join = str.join
    _append = list.append
    _len = len
    _type_name = type.__dict__["__name__"].__get__  # bypasses metaclass tricks on __name__
    _BaseException = BaseException
    _RecursionError = RecursionError

    class _Unsupported(Exception):
        pass

    def _name_of(value: object) -> str:
        try:
            name = _type_name(_type(value))
        except _BaseException:
            name = "?"
        return name if _type(name) is _str else "?"

    def _enc(x: object, out: list, depth: int, budget: list) -> None:
        budget[0] -= 1
        if budget[0] < 0 or depth > MAX_DEPTH:
            raise _Unsupported("value too large or too deeply nested")
        t = _type(x)
        if t is _NoneType:
            _append(out, '["n"]')
        elif t is _bool:
            _append(out, '["b",1]' if x else '["b",0]')
        elif t is _int:
            _append(out, '["i","')
            _append(out, _int_format(x, "x"))
            _append(out, '"]')
        elif t is _float:
            _append(out, '["f","')
            _append(out, _float_repr(x))
            _append(out, '"]')
        elif t is _str or t is _bytes:
            if _len(x) > budget[1]:  # checked before encoding: never copy a huge string
                raise _Unsupported("value too large")
            raw = _str_encode(x, "utf-8", "surrogatepass") if t is _str else x
            budget[1] -= _len(raw)
            if budget[1] < 0:
                raise _Unsupported("value too large")
            _append(out, '["s","' if t is _str else '["y","')
            _append(out, _hex(raw))
            _append(out, '"]')
        elif t is _list or t is _tuple:
            _append(out, '["l",[' if t is _list else '["t",[')
            first = True
            for item in x:
                if not first:
                    _append(out, ",")
                first = False
                _enc(item, out, depth + 1, budget)
            _append(out, "]]")
        elif t is _dict:
            _append(out, '["d",[')
            first = True
            for key, val in _dict_items(x):
                _append(out, "[" if first else ",[")
                first = False
                _enc(key, out, depth + 1, budget)
                _append(out, ",")
                _enc(val, out, depth + 1, budget)
                _append(out, "]")
            _append(out, "]]")
        else:
            raise _Unsupported("unsupported type " + _name_of(x))

    def encode(value: object) -> str:
        out: list = []
        try:
            _enc(value, out, 0, [MAX_NODES, MAX_TEXT_BYTES])
        except _Unsupported as exc:
            if strict:
                raise EncodeError(f"{exc.args[0]} (supported: {SUPPORTED_TYPES})") from None
            reason = exc.args[0] if _type(exc.args[0]) is _str else "unsupported"
            return '["u","' + _hex(_str_encode(reason, "utf-8", "surrogatepass")) + '"]'
        except _RecursionError:
            if strict:
                raise EncodeError("value too deeply nested") from None
            return '["u","' + _hex(b"too deeply nested") + '"]'
        return _join("", out)

    return encode


encode = make_encoder(strict=True)


def decode(tagged: Any, _depth: int = 0, untrusted: bool = False) -> Any:
    """Inverse of the encoder, applied to an already `json.loads`-ed tagged value. Strict: raises DecodeError.

    untrusted=True (values reported by a sandbox child): dicts become `Pairs`, indexed by the canonical text of each
    key, so a child cannot make the parent hash thousands of colliding keys (quadratic dict insertion).
    """
    if _depth > MAX_DEPTH + 1 or type(tagged) is not list or not tagged or type(tagged[0]) is not str:
        raise DecodeError("malformed tagged value")
    tag, n = tagged[0], len(tagged)
    try:
        if tag == "n" and n == 1:
            return None
        if tag == "b" and n == 2 and tagged[1] in (0, 1) and type(tagged[1]) is int:
            return tagged[1] == 1
        if tag == "i" and n == 2 and type(tagged[1]) is str:
            return int(tagged[1], 16)
        if tag == "f" and n == 2 and type(tagged[1]) is str and len(tagged[1]) < 40:
            return float(tagged[1])
        if tag == "s" and n == 2 and type(tagged[1]) is str:
            return bytes.fromhex(tagged[1]).decode("utf-8", "surrogatepass")
        if tag == "y" and n == 2 and type(tagged[1]) is str:
            return bytes.fromhex(tagged[1])
        if tag in ("l", "t") and n == 2 and type(tagged[1]) is list:
            items = [decode(item, _depth + 1, untrusted) for item in tagged[1]]
            return items if tag == "l" else tuple(items)
        if tag == "d" and n == 2 and type(tagged[1]) is list:
            for pair in tagged[1]:
                if type(pair) is not list or len(pair) != 2:
                    raise DecodeError("malformed dict item")
            if untrusted:
                items = []
                for index, (key_tag, value_tag) in enumerate(tagged[1]):
                    key = decode(key_tag, _depth + 1, True)
                    items.append((canonical(key, index), key, decode(value_tag, _depth + 1, True)))
                return Pairs(items)
            out = {}
            for pair in tagged[1]:
                out[decode(pair[0], _depth + 1)] = decode(pair[1], _depth + 1)
            return out
    except DecodeError:
        raise
    except (ValueError, TypeError, UnicodeError, OverflowError, RecursionError) as exc:
        raise DecodeError(f"malformed {tag!r} value: {type(exc).__name__}") from None
    raise DecodeError(f"unknown tag {tag!r}")


def canonical(value: Any, index: int) -> str:
    """The encoder's text for a decoded key: equal text means equal value with equal types. Keys that cannot be
    dict keys (lists, dicts, unsupported values) get a text no expected key can have."""
    try:
        return encode(value)
    except EncodeError:
        return f"unmatchable key {index}"


class Pairs:
    """A dict as reported by a sandbox child: (canonical key text, key, value) triples, never hashed by value."""

    __slots__ = ("items",)

    def __init__(self, items: list[tuple[str, Any, Any]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)


class Unsupported:
    """Decoded form of ["u", reason]: a return value the sandbox refused to serialise. Never equal to anything."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"<unsupported: {self.reason}>"


def decode_result(tagged: Any) -> Any:
    """Like `decode`, but also accepts the child-only ["u", hexreason] tag at the top level."""
    if type(tagged) is list and len(tagged) == 2 and tagged[0] == "u" and type(tagged[1]) is str:
        try:
            return Unsupported(bytes.fromhex(tagged[1][:400]).decode("utf-8", "replace")[:80])
        except ValueError:
            raise DecodeError("malformed 'u' value") from None
    return decode(tagged, untrusted=True)


def dumps(value: Any) -> str:
    """Strict encode to JSON text (parent side)."""
    return encode(value)


def loads(text: str | bytes) -> Any:
    """Parse JSON text produced by an encoder and decode it (strict)."""
    try:
        return decode(json.loads(text))
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, DecodeError):
            raise
        raise DecodeError(f"invalid JSON: {type(exc).__name__}") from None
