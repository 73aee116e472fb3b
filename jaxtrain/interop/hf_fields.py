"""Typed reads of a Hugging Face config.json's fields for import (interop/hf.py, hf_deepseek.py, hf_rope.py): a field
that is missing where it is needed, or of the wrong type or range, is one line naming the field and the file."""

from __future__ import annotations

import math
import numbers
from typing import Any

from jaxtrain.core.errors import UserError

REQUIRED = object()


def _what(kind: str, least) -> str:
  return {"int": "an integer", "number": "a number", "bool": "true or false", "str": "a string",
          "ints": "a list of integers", "list": "a list", "dict": "an object"}[kind] + (
              f" >= {least}" if least is not None else "")


def get(hf: dict, name: str, where: str, kind: str, default: Any = REQUIRED, least: float | None = None) -> Any:
  """hf[name] checked to be of `kind` (int, number, bool, str, ints, list, dict) and >= `least`; JSON null or absent
  is `default` (REQUIRED: a UserError naming the field)."""
  v = hf.get(name)
  if v is None:
    if default is REQUIRED:
      raise UserError(f"{where}: {name} is missing; it must be {_what(kind, least)}")
    return default
  scalar = lambda x: isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)  # noqa: E731
  ok = {"int": lambda: isinstance(v, int) and not isinstance(v, bool), "number": lambda: scalar(v),
        "bool": lambda: isinstance(v, bool), "str": lambda: isinstance(v, str),
        "ints": lambda: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
        "list": lambda: isinstance(v, list), "dict": lambda: isinstance(v, dict)}[kind]()
  if ok and least is not None:
    ok = all(x >= least for x in v) if kind == "ints" else v >= least
  if not ok:
    raise UserError(f"{where}: {name}={v!r} is not supported; it must be {_what(kind, least)}")
  return float(v) if kind == "number" else v
