"""The one exception type users see: a message that names the file, field or tensor at fault."""


class EDSDError(ValueError):
    """A user-facing error: the CLI prints it as one line (exit status 2), never a traceback."""
