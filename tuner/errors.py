"""The one error type users see: its message is one line, and the CLI exits 2 on it."""


class TunerError(Exception):
    """Bad input or an unusable resource, described in one line."""

    def __init__(self, message: object = "", *args: object) -> None:
        # one line always: messages quote user input (file keys, paths) that may hold newlines
        super().__init__(str(message).replace("\r", "\\r").replace("\n", "\\n"), *args)


def one_line(e: BaseException) -> str:
    """An error as one line for a warning: tuner's and the OS's say what; others (a
    MemoryError, a driver's error) are named, with their first line."""
    if isinstance(e, (TunerError, OSError)):
        return str(e)
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
