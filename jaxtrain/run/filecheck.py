"""Checking and hashing a list of files with the work shared out over the processes.

On one process every file is checked in order, as before. On several, each process takes
a disjoint share of the files (`owners`: the same on every process, balanced by bytes), so
what one process reads is about (total bytes / processes), not the total; the shared
filesystem every process already writes its checkpoint shards to is assumed.

- `first_problem` (a collective, main thread): each process checks its share and the
  processes agree on the verdict: the problem of the first faulty file in list order, the
  same text on every process, so each one stops or falls back the same way.
- `hash_to_first`: each process hashes its share of a listing that process 0 made, and
  process 0 receives every digest. It runs in the checkpoint's background thread beside
  training steps, so it goes through the coordination service's key-value store (as
  orbax's own background commits do), never a device collective that could interleave
  with a step's collectives in a different order on different processes.
"""

from __future__ import annotations

import heapq
import json
from pathlib import Path
from typing import Callable, Sequence

from jaxtrain.core import files

TEXT_BYTES = 2048  # a problem's one-line text, as exchanged between processes
NO_PROBLEM = 2**31 - 1  # int32: JAX gathers without 64-bit types
# Bounds only an exchange that has stalled: a process that dies ends the run through the
# runtime's heartbeats well before this; a slow peer is one hashing its own share.
EXCHANGE_TIMEOUT_S = 4 * 3600


def processes() -> tuple[int, int]:
  """(count, index) of this run's processes; (1, 0) without a distributed runtime (no backend started)."""
  import jax
  if not jax.distributed.is_initialized():
    return 1, 0
  return jax.process_count(), jax.process_index()


def owners(sizes: Sequence[int], n: int) -> list[int]:
  """The process that handles each file: largest first, each to the process with the fewest
  bytes so far (lowest index on a tie). Deterministic, so every process computes the same;
  no process gets more than (total / n + the largest file) bytes."""
  heap = [(0, p) for p in range(n)]
  out = [0] * len(sizes)
  for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
    load, p = heapq.heappop(heap)
    out[i] = p
    heapq.heappush(heap, (load + sizes[i], p))
  return out


def first_problem(sizes: Sequence[int], check: Callable[[int], str | None], before: str | None = None) -> str | None:
  """The text `check(i)` returns for the first file i (in list order) that has a problem, or
  None. `sizes[i]` is file i's expected size (it balances the shares). An OSError while
  checking is that file's problem. `before`: a problem this process found before the files
  (e.g. an unreadable manifest); it comes first. With several processes this is a
  collective: every process calls it, with the same list, in the same order."""
  n, me = processes()
  if n == 1:
    if before is not None:
      return before
    for i in range(len(sizes)):
      problem = _checked(check, i)
      if problem is not None:
        return problem
    return None
  local = (-1, before) if before is not None else None
  if local is None:
    own = owners(sizes, n)
    for i in range(len(sizes)):
      if own[i] == me:
        problem = _checked(check, i)
        if problem is not None:
          local = (i, problem)
          break
  return agree(local)


def _checked(check: Callable[[int], str | None], i: int) -> str | None:
  try:
    return check(i)
  except OSError as e:  # unreadable is a problem of that file, not a crash of one process
    return str(e)


def agree(local: tuple[int, str] | None) -> str | None:
  """Collective: of every process's (index, problem text) or None, the text with the lowest
  index (lowest process on a tie), the same on every process."""
  import numpy as np
  from jax.experimental import multihost_utils
  index = np.full((1,), NO_PROBLEM, np.int32)
  text = np.zeros((TEXT_BYTES,), np.uint8)
  if local is not None:
    index[0] = local[0]
    raw = local[1].encode()[:TEXT_BYTES]
    text[:len(raw)] = np.frombuffer(raw, np.uint8)
  got = multihost_utils.process_allgather({"index": index, "text": text})
  indices = np.asarray(got["index"]).reshape(-1)
  first = int(np.argmin(indices))
  if indices[first] == NO_PROBLEM:
    return None
  return bytes(np.asarray(got["text"])[first]).rstrip(b"\0").decode(errors="replace")


# -- hashing a listing at save, digests to process 0 ---------------------------------------

def _client():
  from jax._src import distributed  # the coordination service's client: no public API exposes it
  return distributed.global_state.client


def hash_to_first(directory: Path, key: str, listing: dict[str, int] | None = None) -> dict[str, str] | None:
  """Every process calls this for the same save, `key` naming it uniquely in this job.
  Process 0 passes `listing` {name: size} (names relative to `directory`) and gets
  {name: sha256} of every file; the others hash the share process 0 sends them and get
  None. A process that cannot read a file of its share reports it; process 0 raises it."""
  n, me = processes()
  if n == 1:
    return {name: files.sha256_file(directory / name) for name in sorted(listing)}
  client, timeout_ms = _client(), EXCHANGE_TIMEOUT_S * 1000
  if me != 0:
    share = json.loads(client.blocking_key_value_get(f"{key}/share/{me}", timeout_ms))
    client.key_value_delete(f"{key}/share/{me}")
    if isinstance(share, dict):  # process 0 failed before sharing; it reports why
      return None
    try:
      reply = {"digests": {name: files.sha256_file(directory / name) for name in share}}
    except OSError as e:
      reply = {"error": str(e)}
    client.key_value_set(f"{key}/digests/{me}", json.dumps(reply))
    return None
  names = sorted(listing)
  own = owners([listing[name] for name in names], n)
  for p in range(1, n):
    client.key_value_set(f"{key}/share/{p}", json.dumps([nm for nm, o in zip(names, own) if o == p]))
  digests = {nm: files.sha256_file(directory / nm) for nm, o in zip(names, own) if o == 0}
  errors = []
  for p in range(1, n):
    reply = json.loads(client.blocking_key_value_get(f"{key}/digests/{p}", timeout_ms))
    client.key_value_delete(f"{key}/digests/{p}")
    if "error" in reply:
      errors.append(f"process {p}: {reply['error']}")
    else:
      digests.update(reply["digests"])
  if errors:
    raise OSError("; ".join(errors))
  if sorted(digests) != names:
    raise RuntimeError(f"digests came back for {len(digests)} of {len(names)} files")
  return digests


def cancel(key: str, reason: str) -> None:
  """Process 0 could not list the files: the others stop waiting for their share."""
  n, _ = processes()
  client = _client() if n > 1 else None
  for p in range(1, n):
    client.key_value_set(f"{key}/share/{p}", json.dumps({"error": reason}))
