"""A TokenSet packed into rows addressable by number, with no hidden iterator state: row r
of epoch e is window r of the epoch's shuffled token stream (README, Data: Packing).
"""

from __future__ import annotations

import threading

import numpy as np

from jaxtrain.data.shards import TokenSet
from jaxtrain.core.errors import UserError


def fields_from_rows(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Packed (N, seq_len+1) rows -> model inputs, targets, loss mask, segment ids, positions.
  A target counts only within one document (never padding) and where trainable (not a prompt)."""
  tok, seg, pos = rows["tokens"], rows["tokens_segment_ids"], rows["tokens_positions"]
  valid = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
  if "tokens_trainable" in rows:
    valid &= rows["tokens_trainable"][:, 1:].astype(bool)
  return {
      "inputs": tok[:, :-1].astype(np.int32),
      "targets": tok[:, 1:].astype(np.int32),
      "loss_mask": valid.astype(np.int32),
      "segment_ids": seg[:, :-1].astype(np.int32),
      "positions": pos[:, :-1].astype(np.int32),
  }


class Packer:
  """Rows of one TokenSet. `row(q)` for q = epoch * rows_per_epoch + r, safe from threads."""

  def __init__(self, ts: TokenSet, seq_len: int, seed: int, tag: int, pad_id: int = 0):
    if ts.n_tokens < 2:
      raise UserError(f"data source {ts.name!r} holds fewer than 2 tokens: nothing to train on")
    self.ts, self.L, self.seed, self.tag, self.pad_id = ts, seq_len, seed, tag, pad_id
    self.rows_per_epoch = -(-(ts.n_tokens - 1) // seq_len)
    self._layouts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    self._lock = threading.Lock()

  def layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """The epoch's document order and the stream offset of each (cumulative lengths)."""
    with self._lock:
      if epoch not in self._layouts:
        order = np.random.default_rng([self.seed, self.tag, epoch]).permutation(self.ts.n_docs)
        starts = np.concatenate([[0], np.cumsum(self.ts.lengths[order])])
        if len(self._layouts) >= 2:  # keep the current epoch and the next
          self._layouts.pop(min(self._layouts))
        self._layouts[epoch] = (order, starts)
      return self._layouts[epoch]

  def row(self, q: int) -> dict[str, np.ndarray]:
    """One packed row of L + 1 tokens with segment ids, positions and trainable flags."""
    epoch, r = divmod(q, self.rows_per_epoch)
    order, starts = self.layout(epoch)
    a = r * self.L
    b = min(a + self.L + 1, int(starts[-1]))
    n = self.L + 1
    tok = np.full(n, self.pad_id, np.int32)
    seg, pos, train = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, bool)
    k = int(np.searchsorted(starts, a, side="right")) - 1
    segment = 0
    while k < len(order) and starts[k] < b:
      doc, train_from = self.ts.doc(order[k])
      lo, hi = max(a, starts[k]) - starts[k], min(b, starts[k + 1]) - starts[k]
      at = starts[k] + lo - a
      segment += 1
      tok[at:at + hi - lo] = doc[lo:hi]
      seg[at:at + hi - lo] = segment
      pos[at:at + hi - lo] = np.arange(lo, hi)
      train[at:at + hi - lo] = np.arange(lo, hi) >= train_from
      k += 1
    return {"tokens": tok, "tokens_segment_ids": seg, "tokens_positions": pos, "tokens_trainable": train}
