"""User-facing errors: the CLI prints them as one line and exits with status 2, never a traceback."""


class UserError(Exception):
    """A mistake in what the user gave us (scenario, option, file). `str()` is the whole message."""


class FieldError(UserError):
    """A bad value at a named field, e.g. ``wan.rate``; the message says what is allowed."""

    def __init__(self, field: str, message: str, source: str | None = None) -> None:
        self.field = field
        self.message = message
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{field}: {message}")


class HostError(UserError):
    """The host cannot do what was asked (no root, no netem, missing tool); the message says what to do."""
