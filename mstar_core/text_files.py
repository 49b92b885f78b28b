"""A text file read for a message that names it: what the model directory's JSON files and the
CLI's prompt files share."""

from __future__ import annotations

from pathlib import Path

from mstar_core.errors import InputError


def read_text(path: Path, who: str) -> str:
    """``path``'s UTF-8 text; an unreadable or non-UTF-8 file is an :class:`InputError` that
    starts with ``who`` (the missing, the denied and a directory say so, a bad byte its offset)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"{who} cannot be read ({type(e).__name__}: {e.strerror or e})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{who} is not UTF-8 text (byte offset {e.start}: {e.reason})") from None
