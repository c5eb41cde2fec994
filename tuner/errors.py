"""The one error type users see: its message is one line, and the CLI exits 2 on it."""


class TunerError(Exception):
    """Bad input or an unusable resource, described in one line."""

    def __init__(self, message: object = "", *args: object) -> None:
        # one line always: messages quote user input (file keys, paths) that may hold newlines
        super().__init__(str(message).replace("\r", "\\r").replace("\n", "\\n"), *args)
