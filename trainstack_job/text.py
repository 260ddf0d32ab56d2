"""Shared wording for text that reaches the user: one wording, wherever one is read, for a file that is not
UTF-8 (saved in another encoding, or not a text file at all), and one way to echo a value someone else wrote
(a queue object, an argument) into a message without echoing all of it."""

from __future__ import annotations

CLIP = 80


def not_utf8(error: UnicodeDecodeError) -> str:
    """What is wrong and the fix, for the caller to put after the file's name."""
    return f"not UTF-8 text (byte {error.start}: {error.reason}); save it as UTF-8"


def clip(value: object, limit: int = CLIP) -> str:
    """`value`'s repr, cut after `limit` characters with how long it was: a message that echoes a
    megabyte-long id stays one readable line (the repr escapes newlines and control characters too)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    if isinstance(value, bytes | bytearray):
        size = f"{len(value)} bytes"
    elif isinstance(value, str):
        size = f"{len(value)} characters"
    else:
        size = f"{len(text)} characters as text"
    return f"{text[:limit]}… ({size})"
