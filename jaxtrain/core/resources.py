"""Where the shipped presets live: `configs/` and `meshes/` of a source checkout, else package data."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

_SOURCE_ROOT = Path(__file__).resolve().parents[2]


def folder(kind: str):
  here = _SOURCE_ROOT / kind
  if (_SOURCE_ROOT / "pyproject.toml").is_file() and here.is_dir():
    return here
  try:
    return importlib.resources.files(f"jaxtrain.{kind}")
  except ModuleNotFoundError:
    return here  # neither: names() is then empty and lookups fail with the list of presets


def names(kind: str) -> list[str]:
  base = folder(kind)
  if not base.is_dir():
    return []
  return sorted(p.name[:-5] for p in base.iterdir() if p.name.endswith(".toml"))


def find(kind: str, name: str) -> Path | None:
  """The preset file `name`.toml of `kind`, as a real path."""
  base = folder(kind)
  entry = base / f"{name}.toml"
  if not entry.is_file():
    return None
  if isinstance(entry, Path):
    return entry
  with importlib.resources.as_file(entry) as p:  # wheels unpack to real files; zips are copied once
    return Path(p)
