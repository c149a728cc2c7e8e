"""User-facing errors.

`LosslessError` carries a one-line message that says what went wrong and what to do. The CLI prints it
without a traceback and exits with code 2; library callers can catch it like any exception.
"""


class LosslessError(Exception):
    """A problem with the user's input or environment, explained in one line."""
