"""The protobuf wire format, as much of it as the hand-written encoders of this package need.

Both ``remote_write`` and ``otlp`` write their messages directly in wire format (see each module
for why) out of these few pieces: a field is its tag (field number and wire type, as a varint)
followed by its value, a varint, 8 little-endian bytes, or, length-delimited, the length as a
varint and then the bytes (a string, a nested message, a packed repeated field). Each encoder
names the tag of every field it writes after the proto field, built here by ``tag``; the tags are
bytes made once at import, so a name costs nothing over the literal it replaces.

The reader (``fields``) is the small part the OTLP sink uses to read a receiver's answers.

Stdlib only: importing this loads neither snappy nor protobuf, which the agent does not depend
on (tests/test_otlp.py).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from enum import IntEnum


class WireType(IntEnum):
    """The low three bits of a field's tag (names as in the protobuf encoding guide)."""

    VARINT = 0  # int32, int64, uint32, uint64, bool, enum
    I64 = 1  # fixed64, sfixed64, double
    LEN = 2  # string, bytes, messages, packed repeated fields
    SGROUP = 3  # group start (deprecated, never written or read here)
    EGROUP = 4  # group end (likewise)
    I32 = 5  # fixed32, sfixed32, float


DOUBLE = struct.Struct("<d")  # a double field's 8 bytes
FIXED64 = struct.Struct("<Q")  # a fixed64 field's 8 bytes

INT64_MIN = -(1 << 63)
UINT64_MAX = (1 << 64) - 1
_SMALL = [bytes((n,)) for n in range(0x80)]  # the one-byte varints, made once


def varint(n: int) -> bytes:
    """Base-128 varint of a uint64, or of an int64 (a negative one as its 64-bit two's
    complement, ten bytes, as protobuf encodes int64). Raises ValueError for what fits neither."""
    if 0 <= n < 0x80:
        return _SMALL[n]
    if n < 0:
        if n < INT64_MIN:
            raise ValueError(f"{n} is below int64")
        n += 1 << 64
    elif n > UINT64_MAX:
        raise ValueError(f"{n} is above uint64")
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def tag(number: int, wire_type: WireType) -> bytes:
    """The tag that starts a field: ``number << 3 | wire_type``, as a varint."""
    return varint(number << 3 | wire_type)


def length_delimited(field_tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (``field_tag`` made with ``WireType.LEN``): tag, length, bytes."""
    return field_tag + varint(len(payload)) + payload


def string(field_tag: bytes, text: str) -> bytes:
    """A string field: its UTF-8 bytes, length-delimited."""
    return length_delimited(field_tag, text.encode())


# -- reading -----------------------------------------------------------------------------------


_FIXED_SIZES: dict[int, int] = {WireType.I64: 8, WireType.I32: 4}  # by a tag's wire type, an int


def read_varint(data: bytes, i: int) -> tuple[int, int]:
    """The varint at ``data[i:]`` and the index after it; ValueError if truncated or longer than
    64 bits allow."""
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("bad varint")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7


def fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a message's varint and length-delimited fields, in order; I64
    and I32 fields (none that this package reads) are skipped; raises ValueError on groups, an
    unknown wire type, or a truncated message."""
    i = 0
    while i < len(data):
        field_tag, i = read_varint(data, i)
        number, wire = field_tag >> 3, field_tag & 7
        if wire == WireType.VARINT:
            value, i = read_varint(data, i)
            yield number, value
        elif wire == WireType.LEN:
            length, i = read_varint(data, i)
            if i + length > len(data):
                raise ValueError("truncated")
            yield number, data[i:i + length]
            i += length
        elif wire in _FIXED_SIZES:
            i += _FIXED_SIZES[wire]
            if i > len(data):
                raise ValueError("truncated")
        else:
            raise ValueError(f"wire type {wire}")


def int64(value: int) -> int:
    """A varint read back as int64 or int32 (which protobuf writes sign-extended to 64 bits)."""
    return value - (1 << 64) if value >= 1 << 63 else value
