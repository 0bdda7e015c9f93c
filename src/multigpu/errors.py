"""The one exception type for user mistakes.

A ``UsageError`` carries a one-line message that says what was expected, what
was got, and the fix. The CLI and ``mg.init()`` turn it into that line on
stderr and exit status 2, without a traceback; everything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import sys


class UsageError(ValueError):
    """A user mistake: bad argument, impossible plan, missing file.

    >>> raise UsageError("global batch 96 is not divisible by 64; use 128")
    """

    exit_code = 2

    def exit(self, prog: str = "multigpu") -> None:
        """Print this error as one line on stderr and exit with status 2 (what ``mg.init`` does with one raised
        inside it): for a script that checks its arguments before ``mg.init`` starts any work.

        >>> try:
        ...     args = parse_args()
        ... except mg.UsageError as err:
        ...     err.exit()
        """
        report_usage_error(self, prog)
        raise SystemExit(self.exit_code) from None


def report_usage_error(err: UsageError, prog: str = "multigpu") -> None:
    """Print ``err`` as one line on stderr (no traceback)."""
    msg = " ".join(str(err).split("\n"))
    print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
