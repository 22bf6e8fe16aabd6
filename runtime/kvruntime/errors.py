"""The runtime's own errors: every refusal of bad input is one of these, with a message naming the problem."""


class KVRuntimeError(Exception):
    """Base class: bad input or an unsupported setting, refused before anything is changed. Its text is shown with
    control characters escaped (`printable`): a message may quote a file handed to us (an artifact's architecture),
    and what it quotes must not drive the terminal it is printed on."""

    def __str__(self) -> str:
        return printable(super().__str__())


class ArtifactError(KVRuntimeError):
    """An artifact that cannot be used: unreadable, of another kind or format version, or of another model."""


class UnsupportedModelError(KVRuntimeError):
    """A model whose architecture, cache layout or batch size the runtime cannot compress."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none), for one-line refusals."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def short_repr(value: object, limit: int = 40) -> str:
    """repr(value), cut to `limit` characters: bad input quoted in a one-line message stays short."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def printable(value: object) -> str:
    """`value` as text safe for a terminal: control characters (an escape sequence, a newline) and unpaired
    surrogates written as escapes, so that text from a file handed to us cannot drive the terminal."""
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode() for c in str(value)
    )
