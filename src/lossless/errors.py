"""User-facing errors.

`LosslessError` carries a one-line message that says what went wrong and what to do. The CLI prints it
without a traceback and exits with code 2; library callers can catch it like any exception.
"""


class LosslessError(Exception):
    """A problem with the user's input or environment, explained in one line."""


def not_utf8(path, exc: UnicodeDecodeError, what: str = "file") -> LosslessError:
    """The error for a text file that does not decode as UTF-8 (`exc`), naming the file and the byte."""
    return LosslessError(f"{what} {path} is not UTF-8 text ({exc.reason} at byte {exc.start}): save it as UTF-8")


def read_utf8(path, what: str = "file") -> str:
    """The text of `path`, or a LosslessError naming it when it is not UTF-8 (a missing file raises OSError)."""
    from pathlib import Path

    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise not_utf8(path, exc, what) from None
