"""The host-side run state: step, both token clocks (Python ints: no int32 overflow), skip counters."""

from __future__ import annotations

import dataclasses

from jaxtrain.core.errors import RunAborted


@dataclasses.dataclass
class Progress:
  step: int = 0
  tokens_seen: int = 0
  tokens_updated: int = 0
  skipped_total: int = 0
  skipped_in_a_row: int = 0

  def count(self, step: int, tokens: int, skipped: bool) -> None:
    self.step = step
    self.tokens_seen += tokens
    self.tokens_updated += 0 if skipped else tokens
    self.skipped_total += skipped
    self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0

  def check(self, max_in_a_row: int, loss_scale: float) -> None:
    n, s = self.skipped_in_a_row, self.step
    if n >= max_in_a_row:
      raise RunAborted(f"aborting at step {s}: {n} steps in a row (steps {s - n + 1}-{s}) had non-finite gradients "
                       f"or no valid token (train.max_skipped_in_a_row={max_in_a_row}); loss scale {loss_scale:g}")


@dataclasses.dataclass
class Every:
  """A cadence: due at every multiple of `n` (never when n is 0)."""
  n: int

  def due(self, step: int) -> bool:
    return bool(self.n) and step % self.n == 0
