"""Text from files handed to us, written into Markdown (a bundle's model card): shown as the text it is, never as
markup, HTML or a link. Control characters are escaped first (`printable`), so a value stays on its line."""

from __future__ import annotations

import re
import string

from kvruntime.errors import printable

# HTML's special characters as entities; every other ASCII punctuation mark backslash-escaped (CommonMark lets a
# backslash escape each of them): none can then open markup, a link, emphasis or a table cell.
_LITERAL = {c: "\\" + c for c in string.punctuation} | {"&": "&amp;", "<": "&lt;", ">": "&gt;"}


def markdown_text(value: object) -> str:
    """`value` as literal Markdown text (`[x](javascript:...)`, `<img ...>`, `*`, `|` stay the characters they are)."""
    return "".join(_LITERAL.get(c, c) for c in printable(value))


def markdown_code(value: object) -> str:
    """`value` as an inline code span (shown verbatim, HTML not rendered): fenced by one backtick more than its
    longest run of them, a pipe escaped so that a table cell holds it."""
    text = printable(value).replace("|", "\\|")
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    padding = " " if text.startswith("`") or text.endswith("`") or not text.strip() else ""
    return f"{fence}{padding}{text}{padding}{fence}"
