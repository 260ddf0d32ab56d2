"""The user's text files (job files, configs, the stack file): one wording, wherever one is read, for a file
that is not UTF-8 (saved in another encoding, or not a text file at all)."""

from __future__ import annotations


def not_utf8(error: UnicodeDecodeError) -> str:
    """What is wrong and the fix, for the caller to put after the file's name."""
    return f"not UTF-8 text (byte {error.start}: {error.reason}); save it as UTF-8"
