"""The hang watchdog: a process that completes no step within the bound says so in one line, writes its Python
stacks and the collectives of the step program (any of which may be the one waiting) to the run's log, and exits
EXIT_CODE so that a supervisor restarts the job. A peer that is alive but stuck (in a kernel, in a collective that
never completes) keeps its heartbeats going, so the distributed runtime never ends such a job by itself.

Exit codes: EXIT_CODE (3) here; 1 a run that stopped itself, 2 a user error (docs/training.md)."""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
from pathlib import Path

EXIT_CODE = 3  # not 1 (a run that aborted itself), 2 (a user error) nor 134 (the runtime's abort on a lost peer)
AUTO, OFF = -1.0, 0.0  # run.hang_timeout_s
FLOOR_S, MEDIAN_MULTIPLE = 300.0, 10.0  # the automatic bound: max(FLOOR_S, MEDIAN_MULTIPLE x median step time)
REPORT_LIMIT_S = 60.0  # reading the program's collectives may not hold the exit back longer than this
def bound(timeout_s: float, first_step_s: float, step_times: list[float] | None) -> float:
  """Seconds without a completed step after which the watchdog fires: the first step's bound until one step is
  done (`step_times` None), then `timeout_s`, or (automatic) a multiple of the median step time with a floor."""
  if step_times is None:
    return first_step_s
  if timeout_s != AUTO:
    return timeout_s
  return max(FLOOR_S, MEDIAN_MULTIPLE * statistics.median(step_times)) if step_times else FLOOR_S


def collective_inventory(hlo_text: str, mesh_shape: dict[str, int]) -> str:
  """One line per collective of the compiled program: kind, bytes of one execution, executions per step, its
  replica groups (the first group's devices and the mesh axes they span) and the instruction's name."""
  from jaxtrain.analysis import gpu_compile, hlo_axes
  hlo = gpu_compile.Hlo.parse(hlo_text)
  lines = []
  for i, kind, size, n in gpu_compile.collective_ops(hlo):
    group = hlo_axes.first_group(i.rest)
    axes = "+".join(hlo_axes.axes_of(group, mesh_shape)) or "none"
    lines.append(f"  {kind:<18} {size:>14,} bytes  x{n}/step  {_groups_text(i.rest)}  first group {group}  "
                 f"mesh axes {axes}  %{i.name}")
  head = f"collectives of the step program ({len(lines)}; any of them may be the one waiting):"
  return "\n".join([head, *lines] if lines else [head, "  none"])


def _groups_text(rest: str) -> str:
  """The instruction's own replica_groups= (or source_target_pairs=) attribute, as XLA wrote it."""
  import re

  from jaxtrain.analysis import hlo_axes
  if named := hlo_axes._MESH.search(rest):  # noqa: SLF001 (mesh[...], device_ids=(...) {axes}: its own reader's span)
    return named.group(0)
  m = re.search(r"\b(replica_groups|source_target_pairs)=", rest)
  if not m:
    return "replica_groups=(none written: all devices)"
  depth, end = 0, len(rest)
  for j in range(m.end(), len(rest)):  # up to the comma (or bracket) that closes the attribute
    if rest[j] in "{[(":
      depth += 1
    elif rest[j] in "}])" and depth == 0 or rest[j] == "," and depth == 0:
      end = j
      break
    elif rest[j] in "}])":
      depth -= 1
  return rest[m.start():end]


class Watchdog:
  """A daemon thread fed `beat(step)` when a step's metrics are fetched. A save or an eval runs inside `slow()`:
  watched with the first step's bound, and not counted as a step's time."""

  def __init__(self, timeout_s: float, first_step_s: float, log_path: Path, process: int, checkpoints: Path,
               compiled=None, mesh_shape: dict[str, int] | None = None):
    self.timeout_s, self.first_step_s = timeout_s, first_step_s
    self.log_path, self.process, self.checkpoints = Path(log_path), process, Path(checkpoints)
    self.compiled, self.mesh_shape = compiled, dict(mesh_shape or {})
    self.step, self.last, self._started, self._slow = 0, time.monotonic(), False, False
    self.step_times: collections.deque[float] = collections.deque(maxlen=100)
    self._stop = threading.Event()
    self._thread = None

  def start(self, compiled=None, step: int = 0) -> "Watchdog":
    """Arms the first step's bound from now (before the step is compiled: `compiled` may come later)."""
    if self.timeout_s == OFF:
      return self
    self.compiled = compiled if compiled is not None else self.compiled
    self.step, self.last = step, time.monotonic()
    self._thread = threading.Thread(target=self._watch, name="jaxtrain-watchdog", daemon=True)
    self._thread.start()
    return self

  def beat(self, step: int) -> None:
    now = time.monotonic()
    if self._started:  # the first one includes the compile: not a step time
      self.step_times.append(now - self.last)
    self.step, self.last, self._started = step, now, True

  @contextlib.contextmanager
  def slow(self):
    self._slow = True
    try:
      yield
    finally:
      self._slow, self.last = False, time.monotonic()

  def close(self) -> None:
    self._stop.set()

  def limit(self) -> float:
    """The bound now: inside `slow()`, at least the first step's."""
    limit = bound(self.timeout_s, self.first_step_s, list(self.step_times) if self._started else None)
    return max(limit, self.first_step_s) if self._slow else limit

  def _watch(self) -> None:
    while not self._stop.is_set():
      limit, idle = self.limit(), time.monotonic() - self.last
      if idle >= limit:
        self._fire(idle, limit)
      self._stop.wait(min(1.0, max(0.05, limit - idle)))

  def _fire(self, idle: float, limit: float) -> None:
    """One line on the terminal, the stacks and the collectives in the log, then the exit (never returns)."""
    threading.Timer(REPORT_LIMIT_S, os._exit, (EXIT_CODE,)).start()  # a report that hangs does not hold the exit
    done = f"after step {self.step}" if self._started else f"in the first step ({self.step + 1}, with its compile)"
    try:
      with open(self.log_path, "a") as f:
        f.write(f"\n{time.strftime('%Y-%m-%d %H:%M:%S')} watchdog: process {self.process}: no step completed for "
                f"{idle:.1f}s (bound {limit:.1f}s) {done}; Python stacks of every thread:\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.write("\n" + self._inventory() + "\n")
    except OSError:  # a full disk: the line and the exit still matter
      pass
    key = ("run.hang_first_step_s" if limit == self.first_step_s else
           "run.hang_timeout_s" + (", automatic" if self.timeout_s == AUTO else ""))
    print(f"jaxtrain[process {self.process}]: error: no step completed for {idle:.0f}s {done} (hang watchdog, "
          f"bound {limit:.0f}s: {key}), a process or a collective is stuck, so this process stops "
          f"(exit {EXIT_CODE}){self._last_checkpoint()}; run the same command on every process to go on (stacks "
          f"and the step's collectives in {self.log_path})", file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)

  def _inventory(self) -> str:
    if self.compiled is None:
      return "collectives of the step program: not compiled yet"
    try:
      return collective_inventory(self.compiled.as_text(), self.mesh_shape)
    except Exception as e:  # noqa: BLE001 (the report is best effort; the exit is not)
      return f"collectives of the step program: could not be read ({type(e).__name__}: {e})"

  def _last_checkpoint(self) -> str:
    from jaxtrain.run import checkpoint
    try:
      steps = checkpoint.committed_steps(self.checkpoints)
    except OSError:
      return ""
    return f"; last committed checkpoint: step {steps[-1]}" if steps else "; no checkpoint committed yet"
