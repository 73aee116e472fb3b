"""User-facing errors: one line on stderr and a non-zero exit, never a traceback."""

import sys


class UserError(Exception):
  """A mistake in the user's input (CLI flag, config value, mesh spec)."""


def exit_with(err: UserError, prog: str = "jaxtrain") -> None:
  print(f"{prog}: error: {err}", file=sys.stderr)
  raise SystemExit(2)
