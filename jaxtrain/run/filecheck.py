"""Checking and hashing a list of files, shared out over the processes by bytes (`owners`)."""

from __future__ import annotations

import functools
import heapq
import json
import sys
from pathlib import Path
from typing import Callable, Sequence

from jaxtrain.core import files

TEXT_BYTES = 2048  # a problem's one-line text, as exchanged between processes
NO_PROBLEM = 2**31 - 1  # int32: JAX gathers without 64-bit types
EXCHANGE_TIMEOUT_S = 4 * 3600  # bounds only a stalled exchange; a dead process ends the run by heartbeats


def processes() -> tuple[int, int]:
  """(count, index) of this run's processes; (1, 0) without a distributed runtime (no backend started)."""
  import jax
  if not jax.distributed.is_initialized():
    return 1, 0
  return jax.process_count(), jax.process_index()


def owners(sizes: Sequence[int], n: int) -> list[int]:
  """The process of each file: largest first, each to the least loaded process (lowest on a tie)."""
  heap = [(0, p) for p in range(n)]
  out = [0] * len(sizes)
  for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
    load, p = heapq.heappop(heap)
    out[i] = p
    heapq.heappush(heap, (load + sizes[i], p))
  return out


def first_problem(sizes: Sequence[int], check: Callable[[int], str | None], before: str | None = None) -> str | None:
  """A collective: `check(i)`'s text for the first file i with a problem (`before` comes first), or None."""
  n, me = processes()
  own = owners(sizes, n)
  local = (-1, before) if before is not None else None
  for i in range(len(sizes)) if local is None else ():
    if own[i] != me:
      continue
    try:
      problem = check(i)
    except OSError as e:
      problem = str(e)
    if problem is not None:
      local = (i, problem)
      break
  if n == 1:
    return None if local is None else local[1]
  return agree(local)


def pack(text: str, size: int):
  import numpy as np
  return np.frombuffer(text.encode()[:size].ljust(size, b"\0"), np.uint8).copy()  # zero-padded to `size` bytes


def unpack(buf) -> str:
  import numpy as np
  return bytes(np.asarray(buf)).rstrip(b"\0").decode(errors="replace")


def agree(local: tuple[int, str] | None) -> str | None:
  """Collective: of every process's (index, problem text) or None, the text with the lowest index."""
  import numpy as np
  from jax.experimental import multihost_utils
  index = np.array([NO_PROBLEM if local is None else local[0]], np.int32)
  got = multihost_utils.process_allgather({"index": index, "text": pack(local[1] if local else "", TEXT_BYTES)})
  indices = np.asarray(got["index"]).reshape(-1)
  first = int(np.argmin(indices))
  return None if indices[first] == NO_PROBLEM else unpack(np.asarray(got["text"])[first])


@functools.cache
def _client():
  """The coordination service's key-value client (no public API exposes it, so probed once), or None: then
  process 0 hashes every file itself (slower: one reader instead of all)."""
  try:
    from jax._src import distributed
    client = distributed.global_state.client
    assert all(callable(getattr(client, m)) for m in ("blocking_key_value_get", "key_value_set", "key_value_delete"))
    return client
  except Exception as e:  # noqa: BLE001 (any change there means: not usable)
    print(f"note: jax's key-value client is not reachable ({type(e).__name__}); process 0 hashes every "
          "checkpoint file itself", file=sys.stderr)
    return None


def hash_to_first(directory: Path, key: str, listing: dict[str, int] | None = None) -> dict[str, str] | None:
  """Process 0 passes `listing` {name: size} and gets {name: sha256}; the others hash their share
  (through the key-value store, never a device collective) and get None."""
  n, me = processes()
  if n == 1 or _client() is None:
    return None if me else {name: files.sha256_file(directory / name) for name in sorted(listing)}
  client, timeout_ms = _client(), EXCHANGE_TIMEOUT_S * 1000

  def take(k: str):
    value = json.loads(client.blocking_key_value_get(k, timeout_ms))
    client.key_value_delete(k)
    return value

  if me != 0:
    share = take(f"{key}/share/{me}")
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
    reply = take(f"{key}/digests/{p}")
    if "error" in reply:
      errors.append(f"process {p}: {reply['error']}")
    else:
      digests.update(reply["digests"])
  if errors:
    raise OSError("; ".join(errors))
  return digests


def cancel(key: str, reason: str) -> None:
  """Process 0 could not list the files: the others stop waiting for their share."""
  n = processes()[0]
  for p in range(1, n if n > 1 and _client() else 1):
    _client().key_value_set(f"{key}/share/{p}", json.dumps({"error": reason}))
