"""The one exception type users see: a message that names the file, field or tensor at fault."""


class EDSDError(ValueError):
    """A user-facing error: the CLI prints it as one line (exit status 2), never a traceback."""


def first_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message as one line, for the user error it caused: its first non-empty
    line, cut at ``limit`` characters, or its type's name where it has no message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0][:limit] if lines else type(exc).__name__
