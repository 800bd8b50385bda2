"""The one reader of the TOML files tqbench takes as input (policy files and artifacts, sweep specs, shipped
policies): a file that does not parse is named, with the line and column, in the error.

``tomllib`` alone says only "Expected '=' after a key in a key/value pair (at line 3, column 5)", which does
not say which of the files a command read was wrong.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["TOMLFileError", "read_toml"]

_AT = re.compile(r"\s*\(at line (\d+), column (\d+)\)\s*$")
_AT_END = re.compile(r"\s*\(at end of document\)\s*$")


class TOMLFileError(ValueError):
    """A TOML input file that cannot be read or parsed: the message names it (``path``, ``line``)."""

    def __init__(self, message: str, path: str, line: int | None = None) -> None:
        super().__init__(message)
        self.path, self.line = path, line


def read_toml(path: str | os.PathLike, what: str = "TOML file") -> dict:
    """The parsed table of ``path``; ``TOMLFileError`` naming ``what``, the file and the line when it is not
    UTF-8 or not valid TOML (Python >= 3.11: ``tomllib``)."""
    p = Path(path)
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise TOMLFileError(f"{what} {p}: reading TOML needs Python >= 3.11; use a .json file", str(p)) from None
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TOMLFileError(f"{what} {p}: not UTF-8 text (byte {exc.start}): save it as UTF-8", str(p)) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        msg = str(exc)
        at = _AT.search(msg)
        if at:
            line, col = int(at.group(1)), int(at.group(2))
            where = f"{p}:{line}:{col}"
            msg = msg[: at.start()]
        elif _AT_END.search(msg):  # the file ended inside a value or table (an unclosed [ or quote)
            line = text.count("\n") + 1
            where = f"{p}:{line}"
            msg = _AT_END.sub("", msg) + " at the end of the file"
        else:
            line, where = None, str(p)
        shown = ""
        if line is not None:
            lines = text.splitlines()
            if 1 <= line <= len(lines):
                shown = f" (line {line} reads {lines[line - 1].strip()[:120]!r})"
        raise TOMLFileError(f"{what} {where}: not valid TOML: {msg}{shown}", str(p), line) from None
