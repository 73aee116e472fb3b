"""jax.profiler traces of chosen steps (`run.profile_steps`) into <workdir>/profile/."""

from __future__ import annotations

from pathlib import Path

from jaxtrain.core import parse
from jaxtrain.core.errors import UserError


def parse_steps(text: str) -> tuple[int, int] | None:
  """'5-7' -> (5, 7), '5' -> (5, 5), '' -> None."""
  if not text.strip():
    return None
  a, _, b = text.strip().partition("-")
  try:
    first, last = parse.integer(a), parse.integer(b or a)  # ASCII digits only
  except ValueError:
    raise UserError(f"run.profile_steps={text!r}: write FIRST-LAST or one step, e.g. 5-7") from None
  if not 1 <= first <= last:
    raise UserError(f"run.profile_steps={text!r}: steps start at 1 and FIRST must not exceed LAST")
  return first, last


class Profiler:
  """Traces from before step `first` is dispatched until step `last` has finished."""

  def __init__(self, steps: str, logdir: Path, enabled: bool = True):
    self.window = parse_steps(steps) if enabled else None
    self.logdir, self.active = logdir, False

  def before(self, step: int) -> None:
    if self.window and step == self.window[0]:
      import jax
      self.logdir.mkdir(parents=True, exist_ok=True)
      jax.profiler.start_trace(str(self.logdir))
      self.active = True
      print(f"profiler: tracing steps {self.window[0]}-{self.window[1]} into {self.logdir}", flush=True)

  def after(self, step: int, outputs) -> None:
    if self.active and step >= self.window[1]:
      import jax
      jax.block_until_ready(outputs)
      jax.profiler.stop_trace()
      self.active = False

  def close(self) -> None:
    if self.active:  # the run ended inside the window
      import jax
      jax.profiler.stop_trace()
      self.active = False
