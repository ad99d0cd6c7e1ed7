"""The one exception type that the CLI turns into a one-line message and a non-zero exit."""


class UserError(Exception):
    """Bad input from a user: the message names the problem and the fix.

    ``exit_code`` is 2 for usage/config errors (like argparse) and 1 for everything else.
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code
