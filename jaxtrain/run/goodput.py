"""The goodput ledger: where every second of a job's wall time went, across restarts.

<workdir>/goodput.jsonl gets one JSON line per event, appended and flushed as it happens (a killed trainer
loses nothing written): the supervisor's `job`, `attempt`, `ended` and `job_end`; each trainer's `start`
(its process start, the step it resumed at) and `spent` (seconds of one category, e.g. a step's compute);
`end` when it finished. `summarize` turns them into seconds per category that add up to the job's span:
what no trainer accounted for is start-up/shutdown in a finished attempt and lost work in a failed one.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import jaxtrain
from jaxtrain.core.errors import UserError

FILE = "goodput.jsonl"
# (category, what it holds); `productive` is the goodput
CATEGORIES = {
    "productive": "steps whose result the run kept",
    "startup": "process start-up and shutdown, initialization",
    "compile": "compiling (or loading from the compilation cache) the step",
    "restore": "restoring a checkpoint",
    "data_wait": "waiting for the next batch",
    "checkpoint": "blocking time of checkpoint saves",
    "eval": "evaluation",
    "lost": "work done after the last committed checkpoint and done again after a restart",
    "restart": "between a failed trainer and its restart",
}
ATTEMPT_T = "JAXTRAIN_ATTEMPT_T"  # the supervisor's clock when it started this trainer


def process_start() -> float:
  """When this trainer's start-up began: the supervisor's attempt that started it, else when this program started
  (jaxtrain.STARTED_T; not the process's creation, which a shell's work before its `exec` may precede)."""
  if os.environ.get(ATTEMPT_T):
    return float(os.environ[ATTEMPT_T])
  return jaxtrain.STARTED_T


class Ledger:
  """Appends events to <workdir>/goodput.jsonl; a disabled one (processes other than 0) writes nothing. Events
  wait in memory until the workdir exists (the supervisor starts before the trainer makes it; a refused run
  leaves nothing). A write that fails (a full disk) disables it: the ledger is a report, not a reason to stop."""

  def __init__(self, workdir: Path | None):
    self.path = None if workdir is None else Path(workdir) / FILE
    self.waiting: list[str] = []

  def event(self, ev: str, **fields) -> None:
    if self.path is None:
      return
    self.waiting.append(json.dumps({"ev": ev, "t": fields.pop("t", None) or time.time(), **fields}))
    if not self.path.parent.is_dir():
      return
    try:
      with open(self.path, "a") as f:
        f.write("".join(line + "\n" for line in self.waiting))
      self.waiting = []
    except OSError:
      self.path = None

  def spent(self, cat: str, seconds: float, step: int | None = None, **more) -> None:
    assert cat in CATEGORIES, cat
    self.event("spent", cat=cat, s=max(float(seconds), 0.0), **({"step": step} if step is not None else {}), **more)


class CacheCount:
  """Counts the persistent compilation cache's hits and misses while open (jax.monitoring events): whether a
  (re)started trainer loaded its step or compiled it."""

  HIT, MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"

  def __init__(self):
    import jax
    self.hits = self.misses = 0
    jax.monitoring.register_event_listener(self._on)

  def _on(self, event: str, **_) -> None:
    self.hits += event == self.HIT
    self.misses += event == self.MISS

  def stop(self) -> None:
    import jax
    jax.monitoring.unregister_event_listener(self._on)

  def verdict(self) -> str:
    """'hit' (every program loaded), 'miss' (all compiled), 'partly' (some of each), 'off' (no cache in use)."""
    return {(True, False): "hit", (False, True): "miss", (True, True): "partly"}.get(
        (self.hits > 0, self.misses > 0), "off")


# the events, and the fields checked beside `ev`: name -> (types, valid, what is allowed)
EVENTS = ("job", "attempt", "ended", "job_end", "start", "spent", "end")
_COUNT = (int, lambda v: v >= 0, "an integer >= 0")
_TEXT = (str, lambda v: True, "a text")
_FIELDS = {"t": ((int, float), lambda v: -math.inf < v < math.inf, "a finite number of seconds"),
           "cat": (str, CATEGORIES.__contains__, f"one of {', '.join(CATEGORIES)}"),
           "s": ((int, float), lambda v: 0 <= v < math.inf, "a finite number of seconds >= 0"),
           "step": _COUNT, "resumed": _COUNT, "cause": _TEXT, "cache": _TEXT}


class LedgerError(UserError):
  """A ledger line that this reader cannot use (a file that train or launch did not write)."""


def read(workdir: Path) -> list[dict]:
  """The ledger's events, each checked: a line that is not one (a foreign file) is a LedgerError naming it; a
  line cut by a kill (the start of one that the writers wrote) is skipped."""
  path = Path(workdir) / FILE
  if not path.exists():
    return []
  out = []
  for n, raw in enumerate(path.read_bytes().splitlines(), 1):
    try:
      if raw.strip():
        out.append(_event(raw.decode("utf-8")))
    except (json.JSONDecodeError, RecursionError) as e:
      if not raw.startswith(b'{"ev": "'):
        raise LedgerError(f"{path}: line {n}: not a JSON record ({getattr(e, 'msg', e)}); is this a goodput "
                          "ledger?") from None
    except UnicodeDecodeError as e:
      raise LedgerError(f"{path}: line {n}: not UTF-8 text (byte {e.start}); is this a goodput ledger?") from None
    except ValueError as e:
      raise LedgerError(f"{path}: line {n}: {e}") from None
  return out


def _event(line: str) -> dict:
  """One ledger line as its event; ValueError saying what is wrong."""
  e = json.loads(line)
  if not isinstance(e, dict) or e.get("ev") not in EVENTS:
    raise ValueError(f"{line[:60]} is not an event (a JSON object whose 'ev' is one of {', '.join(EVENTS)})")
  for k in ("t", "cat", "s") if e["ev"] == "spent" else ("t",):
    if k not in e:
      raise ValueError(f"a {e['ev']!r} event without {k!r}")
  for k, v in e.items():
    if k in _FIELDS and not (isinstance(v, _FIELDS[k][0]) and not isinstance(v, bool) and _FIELDS[k][1](v)):
      raise ValueError(f"{e['ev']!r} event: {k} {json.dumps(v)[:60]} is not {_FIELDS[k][2]}")
  return e


def _attempts(events: list[dict]) -> list[dict]:
  """The trainer attempts, each from its `start`: its `spent` events, its own `end`, and the supervisor's
  `ended` (when the supervisor saw it exit), whichever came."""
  attempts, cur = [], None
  for e in events:
    if e["ev"] == "start":
      cur = {"start": e["t"], "resumed": e.get("resumed", 0), "spent": [], "end": None, "ended": None, "last": e["t"]}
      attempts.append(cur)
    elif cur is None:
      continue
    elif e["ev"] == "spent":
      cur["spent"].append(e)
      cur["last"] = max(cur["last"], e["t"])
    elif e["ev"] == "end":
      cur["end"] = cur["last"] = max(cur["last"], e["t"])
    elif e["ev"] == "ended" and cur["ended"] is None:
      cur["ended"] = e["t"]
  return attempts


def jobs(events: list[dict]) -> list[list[dict]]:
  """The events split into jobs: a job starts at a supervisor's `job`, or at a trainer's `start` after one
  that finished (a later `--steps` on the same workdir), not after a failed one (that is a restart)."""
  out: list[list[dict]] = []
  finished, supervised = True, False
  for e in events:
    new = e["ev"] == "job" or (e["ev"] == "start" and finished and not supervised)
    if new or not out:
      out.append([])
    out[-1].append(e)
    if e["ev"] == "job":
      supervised = True
    elif e["ev"] == "job_end":
      supervised = False
    if e["ev"] in ("start", "end"):
      finished = e["ev"] == "end"
  return out


def summarize(events: list[dict]) -> dict | None:
  """The last job's {wall_s, seconds: {category: s}, lost_steps, attempts, goodput}: the categories add up to
  wall_s, the span from its first event to its last."""
  events = jobs(sorted(events, key=lambda e: e["t"]))[-1] if events else []  # two writers: one host's clock
  attempts = _attempts(events)
  if not attempts:
    return None
  secs = dict.fromkeys(CATEGORIES, 0.0)
  first, last = min(e["t"] for e in events), max(e["t"] for e in events)
  secs["startup"] += attempts[0]["start"] - first  # the supervisor's own start
  lost_steps = 0
  for i, a in enumerate(attempts):
    stop = max(a["ended"] or 0.0, a["last"])
    kept_up_to = attempts[i + 1]["resumed"] if i + 1 < len(attempts) else None
    accounted = 0.0
    redone = {e["step"] for e in a["spent"] if kept_up_to is not None and e.get("step", 0) > kept_up_to}
    lost_steps += len(redone)  # started (a batch fetched for it) after the checkpoint the next attempt resumed
    for e in a["spent"]:
      cat = "lost" if e["cat"] == "productive" and e.get("step") in redone else e["cat"]
      secs[cat] += e["s"]
      accounted += e["s"]
    # what the trainer did not account for: shutdown if it finished, else the work in flight when it died
    secs["startup" if a["end"] is not None else "lost"] += max(stop - a["start"] - accounted, 0.0)
    nxt = attempts[i + 1]["start"] if i + 1 < len(attempts) else last
    secs["restart" if i + 1 < len(attempts) else "startup"] += max(nxt - stop, 0.0)
  wall = last - first
  caches = [e["cache"] for a in attempts for e in a["spent"] if e["cat"] == "compile" and "cache" in e]
  return {"wall_s": wall, "seconds": secs, "lost_steps": lost_steps, "attempts": len(attempts),
          "compile_cache": caches, "goodput": secs["productive"] / wall if wall > 0 else None}


def describe(summary: dict) -> str:
  """'goodput 91.4%: productive 55.0s of 60.2s; lost 3.1s (1 step), restart 1.0s, ...' (the largest first)."""
  s, wall = summary["seconds"], summary["wall_s"]
  rest = sorted(((v, k) for k, v in s.items() if k != "productive" and v >= 0.05), reverse=True)
  notes = {"lost": f" ({summary['lost_steps']} step{'s' * (summary['lost_steps'] != 1)} redone)"
           if summary["lost_steps"] else "",
           "compile": f" (cache: {', '.join(summary['compile_cache'])})" if summary.get("compile_cache") else ""}
  parts = [f"{k} {v:.1f}s{notes.get(k, '')}" for v, k in rest]
  pct = f"{summary['goodput']:.1%}" if summary["goodput"] is not None else "n/a"
  return (f"goodput {pct}: productive {s['productive']:.1f}s of {wall:.1f}s over {summary['attempts']} "
          f"attempt{'s' * (summary['attempts'] != 1)}" + (f"; {', '.join(parts)}" if parts else ""))
