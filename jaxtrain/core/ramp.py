"""The global batch of each step under train.batch_ramp ("tokens:size,..."), and the run's length in steps.

The size of step s is the ramp's size at the tokens fed before it (sequences x train.seq_len, padding included):
a pure function of s, whatever was skipped or masked, so that the data order (the global row stream cut into
steps) is the same on every mesh and after every resume."""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math

from jaxtrain.core import parse
from jaxtrain.core.errors import UserError


def parse_ramp(text: str) -> tuple[tuple[int, int], ...]:
  """"0:256,1e9:512" -> ((0, 256), (1000000000, 512)): thresholds from 0, strictly rising; sizes >= 1. () if
  empty."""
  out: list[tuple[int, int]] = []
  for item in parse.items(text, "train.batch_ramp"):
    at, colon, size = item.partition(":")
    try:
      tokens = float(at) if at.strip().isascii() else math.nan
      if not colon or not math.isfinite(tokens) or tokens != int(tokens) or tokens < 0:
        raise ValueError
      n = parse.integer(size)
    except ValueError:
      raise UserError(f"train.batch_ramp={text!r}: item {item!r} must be tokens:sequences (tokens a whole number "
                      ">= 0 such as 1e9, sequences an integer)") from None
    if n < 1:
      raise UserError(f"train.batch_ramp={text!r}: item {item!r} has {n} sequences; each size must be >= 1")
    out.append((int(tokens), n))
  if out and out[0][0] != 0:
    raise UserError(f"train.batch_ramp={text!r} must start at 0 tokens (the first step's size), e.g. '0:256,...'")
  if any(b[0] <= a[0] for a, b in zip(out, out[1:])):
    raise UserError(f"train.batch_ramp={text!r}: the token thresholds must rise strictly")
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Ramp:
  """Steps grouped in phases of one size: (first step, rows before it, size), one per phase that has steps."""
  seq_len: int
  phases: tuple[tuple[int, int, int], ...]

  def size(self, step: int) -> int:
    """Sequences in the global batch of 0-based step `step`."""
    return self.phases[self._phase(step)][2]

  def rows_before(self, step: int) -> int:
    """Sequences fed by steps 0..step-1: where step `step`'s rows start in the global row stream."""
    first, rows, size = self.phases[self._phase(step)]
    return rows + (step - first) * size

  def steps_for(self, tokens: int) -> int:
    """The fewest steps whose fed tokens (sequences x seq_len) reach `tokens` (at least 1)."""
    for i, (first, rows, size) in enumerate(self.phases):
      end = self.phases[i + 1][0] if i + 1 < len(self.phases) else None
      need = max(0, -(-(tokens - rows * self.seq_len) // (size * self.seq_len)))
      if end is None or first + need <= end:
        return max(1, first + need)
    raise AssertionError("the last phase has no end")

  def sizes(self) -> tuple[int, ...]:
    return tuple(sorted({p[2] for p in self.phases}))

  def _phase(self, step: int) -> int:
    return bisect.bisect_right([p[0] for p in self.phases], step) - 1


@functools.cache
def build(batch_ramp: str, batch_size: int, seq_len: int) -> Ramp:
  """The ramp of train.batch_ramp (empty: batch_size at every step)."""
  points = parse_ramp(batch_ramp) or ((0, batch_size),)
  phases, step, rows = [], 0, 0
  for i, (_, size) in enumerate(points):
    if i + 1 == len(points):
      phases.append((step, rows, size))
      break
    n = max(0, -(-(points[i + 1][0] - rows * seq_len) // (size * seq_len)))  # steps before the next threshold
    if n:
      phases.append((step, rows, size))
      step, rows = step + n, rows + n * size
  return Ramp(seq_len, tuple(phases))


def of(cfg) -> Ramp:
  t = cfg.train
  return build(t.batch_ramp, t.batch_size, t.seq_len)


def run_steps(cfg) -> int:
  """The run's length in steps: train.steps, or with train.tokens the steps that feed that many tokens."""
  t = cfg.train
  return of(cfg).steps_for(math.ceil(t.tokens)) if t.tokens else t.steps
