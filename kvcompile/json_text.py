"""JSON read from files that may be damaged or hostile: one line saying what is wrong, never a traceback."""

from __future__ import annotations

import json


class NotJSON(ValueError):
    """Text that `parse_json` cannot read, its message the problem in words."""


def parse_json(text: str, one_line: bool = False) -> object:
    """`text` parsed, or NotJSON saying why not (where: the column alone in `one_line` text). A deeply nested value raises RecursionError and a number past
    Python's digit limit a plain ValueError in `json.loads`: both are a damaged (or hostile) file, not a bug."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        at = f"column {exc.colno}" if one_line else f"line {exc.lineno} column {exc.colno}"
        raise NotJSON(f"is not JSON ({exc.msg} at {at})") from None
    except RecursionError:
        raise NotJSON("is nested too deep to read") from None
    except ValueError:
        raise NotJSON("holds a number too long to read") from None
