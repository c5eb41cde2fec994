"""The one error type users see: its message is one line, and the CLI exits 2 on it."""


class TunerError(Exception):
    """Bad input or an unusable resource, described in one line."""
