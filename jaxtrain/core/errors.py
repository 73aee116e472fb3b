"""User-facing errors: one line on stderr and a non-zero exit, never a traceback."""

import errno
import os
import sys


class UserError(Exception):
  """A mistake in the user's input (CLI flag, config value, mesh spec)."""


class RunAborted(Exception):
  """Training cannot usefully go on (e.g. too many non-finite steps in a row)."""


def exit_with(err: Exception, prog: str = "jaxtrain") -> None:
  """One line on stderr; exit 2 for a user mistake, 1 for an aborted run."""
  print(f"{prog}: error: {err}", file=sys.stderr)
  raise SystemExit(2 if isinstance(err, UserError) else 1)


# A path that cannot be used as written: a mistake to fix, not a fault to retry (a missing file or a full disk
# each has its own line where it is met; an I/O error stays a failure the supervisor restarts).
PATH_ERRNOS = {errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.EACCES, errno.EPERM, errno.EROFS}


def path_error(e: OSError) -> UserError | None:
  """`e` as one line naming its path and the problem, if it is a PATH_ERRNOS error about a path; else None."""
  if e.errno not in PATH_ERRNOS or not isinstance(e.filename, (str, bytes, os.PathLike)):
    return None
  path = os.fsdecode(e.filename)
  where = path if e.filename2 is None else f"{path} -> {os.fsdecode(e.filename2)}"
  problem = e.strerror or os.strerror(e.errno)
  return UserError(f"{where}: {problem[:1].lower()}{problem[1:]}{_detail(e.errno, path)}")


def _detail(code: int, path: str) -> str:
  """Which part of the path is at fault, where the error alone does not say."""
  parts = os.path.abspath(path).split(os.sep)
  if code == errno.ENAMETOOLONG:
    longest = max(parts, key=lambda p: len(os.fsencode(p)))
    at = os.sep.join(parts[:parts.index(longest)]) or os.sep
    try:  # the limit of the filesystem the name would be on (the deepest directory that exists)
      while not os.path.isdir(at):  # the root always is one
        at = os.path.dirname(at)
      limit = os.pathconf(at, "PC_NAME_MAX")
    except (OSError, ValueError):
      limit = 255
    if len(os.fsencode(longest)) > limit:
      return f" (a name in it has {len(os.fsencode(longest))} bytes; this filesystem allows {limit})"
    return f" (the path has {len(os.fsencode(path))} bytes, more than the system allows)"
  if code == errno.ENOTDIR:
    for i in range(1, len(parts)):
      head = os.sep.join(parts[:i])
      if head and os.path.lexists(head) and not os.path.isdir(head):
        return f" ({head} is not a directory)"
  return ""
