"""Errors that reach the user as one clear line (no traceback)."""

__all__ = ["UserError"]


class UserError(Exception):
    """A mistake the user can fix (bad flag, missing file, unreachable peer, ...).

    The CLI prints ``error: <message>`` and exits with :attr:`exit_code`; never a traceback.
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code
