"""Typed configuration: a Config from a TOML preset or file and `--set section.key=value` overrides, each value
checked against its key's type and bounds, then the cross-key checks. The keys themselves are in core.schema, the
dependent-keys table in core.dependent and the checks in core.checks; this module is where the rest of jaxtrain
reads all of them (`config.Config`, `config.load`, `config.ignored`)."""

from __future__ import annotations

import dataclasses
import functools
import math as _math
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from jaxtrain.core import parse, ramp as ramp_lib, resources
from jaxtrain.core.checks import check_in_backward, check_optim, check_qk_clip, validate  # noqa: F401 (the API)
from jaxtrain.core.dependent import DEPENDENT, LORA_KEYS, Needs, ignored, inactive, value_of  # noqa: F401
from jaxtrain.core.errors import UserError
from jaxtrain.core.schema import (  # noqa: F401 (config is where the rest of jaxtrain reads the schema)
    ALLOW_MISMATCH, ALTERNATIVES, LORA_TARGETS, MISMATCH_CATEGORIES, OPTIMIZER_SWITCH, RENAMED, SECTIONS, SWITCHES,
    TRACKERS, Config, ModelConfig, OptimConfig, all_keys, category, fields)


_CHECKS = {bool: (lambda v: isinstance(v, bool), "is not a bool; use true or false"),
           int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "is not an integer"),
           float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "is not a number"),
           str: (lambda v: isinstance(v, str), "is not a string")}


def _coerce(where: str, tp: Any, value: Any, *, from_text: bool) -> Any:
  """Checks (and for CLI text, parses) `value` against the field type `tp`."""
  if get_origin(tp) is Literal:
    if value not in get_args(tp):
      raise UserError(f"{where}={value!r} is not allowed; choose one of: {', '.join(get_args(tp))}")
    return value
  if from_text and isinstance(value, str):
    if tp is bool and value.lower() in ("true", "false"):
      value = value.lower() == "true"
    elif tp is int:
      try:
        value = parse.integer(value)
      except ValueError as e:  # int() would take full-width digits; '--5' and '1e3' are not integers either
        raise UserError(f"{where}={value!r} {e}") from None
    elif tp is float:
      if not value.isascii():  # float() too would take full-width digits
        raise UserError(f"{where}={value!r} is not a number" + (
            ": a number is written in ASCII digits (0-9)" if any(c.isdigit() for c in value) else ""))
      try:
        value = float(value)
      except ValueError:
        pass
  ok, what = _CHECKS[tp]
  if not ok(value):
    raise UserError(f"{where}={value!r} {what}")
  if tp is float and not _math.isfinite(value):
    raise UserError(f"{where}={value} is not a finite number")
  return float(value) if tp is float else value


@dataclasses.dataclass
class _Given:
  """Where a key got its value, to refuse a second, different one in the same layer (the file, --set, a variant):
  the name it was written under and how to name it in the error."""
  layer: int
  spelled: str
  value: Any
  label: str


@functools.cache
def _hints(cls) -> dict[str, Any]:
  """A section's resolved type hints: resolving them takes most of a config load (the planner loads thousands)."""
  return typing.get_type_hints(cls)


def _set(raw: dict[str, dict[str, Any]], dotted: str, value: Any, *, from_text: bool, renamed: set[str],
         given: dict[str, _Given], layer: int, label: str) -> None:
  spelled = dotted
  if dotted in SWITCHES:
    dotted, value, from_text = _switch(raw, spelled, value, from_text=from_text)
  if dotted in RENAMED:
    renamed.add(dotted)
    dotted = RENAMED[dotted]
  section, _, name = dotted.partition(".")
  if section not in SECTIONS:
    raise UserError(f"unknown config section {section!r} in {dotted!r}; sections: {', '.join(SECTIONS)}")
  fs = fields(section)
  if name not in fs:
    raise UserError(f"unknown config key {dotted!r}; keys of [{section}]: {', '.join(fs)}")
  meta = fs[name].metadata
  tp = _hints(SECTIONS[section])[name]
  value = _coerce(spelled, tp, value, from_text=from_text)
  lo, hi = meta["min"], meta["max"]
  for broken, what in ((lo is not None and value < lo, f"is below its minimum {lo}"),
                       (lo is not None and meta["open_min"] and value == lo, f"must be greater than {lo}"),
                       (hi is not None and meta["open_max"] and value >= hi, f"must be less than {hi}"),
                       (hi is not None and value > hi, f"is above its maximum {hi}")):
    if broken:
      raise UserError(f"{spelled}={value} {what}")
  # A later layer (--set over the file) overrides, and so does a later --set of the same name (scripts append an
  # override to a base command). In one layer, one key under its old and new names (train.lr and optim.lr) with
  # different values has no one meaning: neither spelling is the later word on the other.
  prev = given.get(dotted)
  if prev is not None and prev.layer == layer and (prev.spelled in SWITCHES) != (spelled in SWITCHES):
    # an on/off switch beside the list it edits: which was meant last has no one answer
    raise UserError(f"{prev.label} and {label} both set {dotted}; give {dotted} only")
  if prev is not None and prev.value != value and prev.layer == layer and prev.spelled != spelled:
    raise UserError(f"{prev.label} and {label} both set {dotted} but differ; give it once")
  given[dotted] = _Given(layer, spelled, value, label)
  raw.setdefault(section, {})[name] = value


def _switch(raw: dict, spelled: str, value: Any, *, from_text: bool) -> tuple[str, str, bool]:
  """An old on/off switch (run.tensorboard) as the list key it edits, from its value so far: (key, new list,
  from_text=False)."""
  target, name = SWITCHES[spelled]
  on = _coerce(spelled, bool, value, from_text=from_text)
  section, _, key_name = target.partition(".")
  current = raw.get(section, {}).get(key_name, fields(section)[key_name].default)
  names = [n.strip() for n in current.split(",") if n.strip() and n.strip() != name]
  return target, ",".join([name] * on + names), False


def preset_names() -> list[str]:
  return resources.names("configs")


def from_dict(doc: dict[str, Any], overrides: list[str] = (), where: str = "config", then: list[str] = ()) -> Config:
  """A Config from nested {section: {key: value}} (TOML, or a stored config.json) plus overrides, then `then`
  (a second layer of overrides, e.g. a bench variant's over --set)."""
  raw: dict[str, dict[str, Any]] = {}
  renamed: set[str] = set()
  given: dict[str, _Given] = {}
  for section, table in doc.items():
    if not isinstance(table, dict):
      raise UserError(f"{where}: top-level key {section!r} must be a [section]; sections: {', '.join(SECTIONS)}")
    for name, value in table.items():
      _set(raw, f"{section}.{name}", value, from_text=False, renamed=renamed, given=given, layer=0,
           label=f"{where} [{section}] {name} = {value!r}")
  for layer, items in ((1, overrides), (2, then)):
    for item in items:
      dotted, eq, value = item.partition("=")
      if not eq or "." not in dotted:
        raise UserError(f"--set {item!r} must look like section.key=value")
      _set(raw, dotted.strip(), value.strip(), from_text=True, renamed=renamed, given=given, layer=layer,
           label=f"--set {item.strip()}")
  _later_layer_wins(raw, given)
  if renamed:
    print(f"note: renamed config keys accepted: {', '.join(f'{k} -> {RENAMED[k]}' for k in sorted(renamed))}",
          file=sys.stderr)
  cfg = Config(**{s: SECTIONS[s](**raw.get(s, {})) for s in SECTIONS})
  validate(cfg)
  return cfg


def _later_layer_wins(raw: dict, given: dict[str, _Given]) -> None:
  """The alternatives of ALTERNATIVES, and train.batch_size from train.batch_ramp's largest size: what a later
  layer gives replaces what an earlier one said the other way (back to its default)."""
  for a, b in ALTERNATIVES:
    if a in given and b in given and given[a].layer != given[b].layer:
      loser = a if given[a].layer < given[b].layer else b
      section, _, name = loser.partition(".")
      raw[section].pop(name, None)
      warm = given.get("optim.warmup_tokens")
      if loser == "train.tokens" and warm is not None and warm.layer < given[a].layer:  # steps again: its warmup
        raw["optim"].pop("warmup_tokens", None)
  ramp_given, size_given = given.get("train.batch_ramp"), given.get("train.batch_size")
  if ramp_given is not None and (size_given is None or size_given.layer < ramp_given.layer):
    points = ramp_lib.parse_ramp(ramp_given.value)
    if points:
      raw["train"]["batch_size"] = max(n for _, n in points)


def run_name(name_or_path: str) -> str:
  """The name a run is shown and stored under (runs/<name>): a preset's full name, dots
  included (llama3.1-8b), or a .toml file's stem; the same test as `load`'s."""
  path = Path(name_or_path)
  return path.stem if path.suffix == ".toml" or path.exists() else name_or_path


def load(name_or_path: str = "tiny", overrides: list[str] = (), then: list[str] = ()) -> Config:
  """Builds a Config from a preset (name in configs/ or a path) plus `section.key=value` overrides (then `then`,
  which may override those)."""
  path = Path(name_or_path)
  if path.suffix == ".toml" or path.exists():
    if not path.is_file():
      raise UserError(f"config file {name_or_path!r} does not exist")
  elif (path := resources.find("configs", name_or_path)) is None:
    raise UserError(f"unknown config {name_or_path!r}; presets: {', '.join(preset_names())} (or a path to a .toml "
                    "file)")
  try:
    doc = tomllib.loads(path.read_text(encoding="utf-8-sig"))  # a byte-order mark is no TOML
  except tomllib.TOMLDecodeError as e:
    raise UserError(f"config file {str(path)!r} is not valid TOML: {e}") from None
  except (OSError, UnicodeDecodeError) as e:
    raise UserError(f"config file {str(path)!r} cannot be read: {e}") from None
  return from_dict(doc, overrides, path.name, then)


def help_text() -> str:
  """Every key with its type, default, meaning, and whether it is part of the run's identity."""
  lines = []
  for section, cls in SECTIONS.items():
    lines.append(f"[{section}]")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      tp, role = hints[f.name], "same-run" if f.metadata["math"] else "free"
      kind = "one of " + ", ".join(map(str, get_args(tp))) if get_origin(tp) is Literal else tp.__name__
      lines.append(f"  {section}.{f.name} ({kind}, default {f.default!r}) [{role}]")
      lines.append(f"      {f.metadata['doc']}")
      if whens := [n.when for n in DEPENDENT if f"{section}.{f.name}" in n.keys]:
        lines.append(f"      Acts only with {'; and with '.join(whens)}.")
  lines += ["", "same-run: part of the checkpoint's fingerprint (a resume with another value is refused unless "
            "--allow-mismatch); free: may change on resume. A key that acts only with another (or a mesh axis) is "
            "elsewhere ignored: named on the run's 'ignored:' line and left out of the fingerprint.",
            "Renamed keys still accepted: " + ", ".join(f"{k} -> {v}" for k, v in RENAMED.items()),
            "Older switches still accepted: " + ", ".join(f"{k}=true/false adds/removes {n} in {t}"
                                                          for k, (t, n) in SWITCHES.items())]
  return "\n".join(lines)
