"""Protobuf wire bytes written by hand, for tests that send what the protobuf library would not
write (fields a version does not know, lengths that lie)."""

from __future__ import annotations


def varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf base-128 varint, least significant group first."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def length_delimited(number: int, payload: bytes) -> bytes:
    """Field ``number`` of wire type 2 holding ``payload``."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload
