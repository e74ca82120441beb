"""Exceptions with messages meant for people: one line that names the record or thing and the problem."""


def first_line(exc: BaseException, width: int = 160) -> str:
    """``Type: first line of the message`` of an exception from elsewhere (a library's), cut to ``width``."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:width]}"


class HalwatchError(Exception):
    """Base class of every error halwatch raises on purpose."""


class InputError(HalwatchError):
    """A record of the input is unusable. ``where`` names it (``file:line`` and/or ``id``)."""

    def __init__(self, problem: str, where: str | None = None):
        self.problem = problem
        self.where = where
        super().__init__(f"{where}: {problem}" if where else problem)


class ModelError(HalwatchError):
    """A scoring model cannot be found, downloaded, verified or loaded."""
