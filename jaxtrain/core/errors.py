"""User-facing errors: one line on stderr and a non-zero exit, never a traceback."""

import sys


class UserError(Exception):
  """A mistake in the user's input (CLI flag, config value, mesh spec)."""


class RunAborted(Exception):
  """Training cannot usefully go on (e.g. too many non-finite steps in a row)."""


def exit_with(err: Exception, prog: str = "jaxtrain") -> None:
  """One line on stderr; exit 2 for a user mistake, 1 for an aborted run."""
  print(f"{prog}: error: {err}", file=sys.stderr)
  raise SystemExit(2 if isinstance(err, UserError) else 1)
