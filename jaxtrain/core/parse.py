"""The one reading of integers and comma lists in user text (flags, --set values, mesh sizes, list flags):
integers in ASCII digits only (Python's int() also takes full-width and other Unicode digits, and '1_0'),
lists without empty items."""

from __future__ import annotations

import re

from jaxtrain.core.errors import UserError

_INT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*")  # what int() takes, less the non-ASCII digits and surrounding space


def integer(text: str) -> int:
  """`text` (surrounding spaces ignored) as an int; ValueError saying what is wrong (it completes '<flag> <value> ')."""
  t = text.strip()
  if _INT.fullmatch(t):
    return int(t)
  if not t.isascii() and any(c.isdigit() for c in t):
    raise ValueError("is not an integer: an integer is written in ASCII digits (0-9)")
  raise ValueError("is not an integer")


def int_arg(text: str) -> int:
  """argparse's `type=int` in every jaxtrain command (cli.Parser registers it): ASCII digits only."""
  import argparse
  try:
    return integer(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"{text!r} {e}") from None


def items(text: str, what: str) -> list[str]:
  """A comma list: its items stripped; an empty item (a doubled, leading or trailing comma) is a UserError."""
  parts = [p.strip() for p in text.split(",")]
  if not text.strip():
    return []
  for i, p in enumerate(parts):
    if not p:
      raise UserError(f"{what} {text!r}: item {i + 1} of {len(parts)} is empty; write items separated by single "
                      "commas")
  return parts


def int_items(text: str, what: str) -> list[int]:
  """A comma list of integers (ASCII digits), each named when it is not one."""
  out = []
  for p in items(text, what):
    try:
      out.append(integer(p))
    except ValueError as e:
      raise UserError(f"{what} {text!r}: item {p!r} {e}") from None
  return out


def float_arg(text: str) -> float:
  """argparse's `type=float` in every jaxtrain command: ASCII only (nan and inf pass; each flag bounds its own)."""
  import argparse
  try:
    if text.isascii():
      return float(text)
  except ValueError:
    pass
  raise argparse.ArgumentTypeError(f"{text!r} is not a number" + ("" if text.isascii() else
                                                                  ": a number is written in ASCII digits (0-9)"))
