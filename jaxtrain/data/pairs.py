"""Preference pairs as training rows (train.objective=dpo): row 2i is the chosen response of a pair and row 2i + 1
its rejected one, each alone in its row, padded (never packed: a pair's two sequences must stay side by side so
that the step keeps them in one microbatch on one device; jaxtrain.run.dpo)."""

from __future__ import annotations

import threading

import numpy as np

from jaxtrain.core.config import Config
from jaxtrain.core.errors import UserError
from jaxtrain.data import shards

PAIR_TAG = 0x504149  # the pair order's own random stream


class PairPacker:
  """Rows of one preference TokenSet, the Packer's interface: `row(q)` for q = epoch * rows_per_epoch + r, the
  pairs in a fresh order each epoch. A sequence longer than train.seq_len + 1 tokens loses its end."""

  def __init__(self, ts: shards.TokenSet, seq_len: int, seed: int, tag: int, pad_id: int = 0):
    if ts.n_docs < 2 or ts.n_docs % 2:
      raise UserError(f"data source {ts.name!r} holds {ts.n_docs} documents, not whole preference pairs")
    self.ts, self.L, self.seed, self.tag, self.pad_id = ts, seq_len, seed, tag, pad_id
    self.rows_per_epoch = ts.n_docs
    self._orders, self._lock = {}, threading.Lock()

  def order(self, epoch: int) -> np.ndarray:
    with self._lock:
      if epoch not in self._orders:
        if len(self._orders) >= 2:  # keep the current epoch and the next
          self._orders.pop(min(self._orders))
        self._orders[epoch] = np.random.default_rng([self.seed, self.tag, PAIR_TAG, epoch]).permutation(
            self.ts.n_docs // 2)
      return self._orders[epoch]

  def most_segments(self, rows: int) -> int:
    """Segments in a row's inputs (the first L tokens): the sequence, and padding where one is shorter."""
    return 1 if int(self.ts.lengths.min()) >= self.L else 2

  def row(self, q: int) -> dict[str, np.ndarray]:
    """One row of L + 1 tokens: one sequence from position 0, then padding (segment 0)."""
    epoch, r = divmod(q, self.rows_per_epoch)
    doc, train_from = self.ts.doc(2 * int(self.order(epoch)[r // 2]) + r % 2)
    n, used = self.L + 1, min(len(doc), self.L + 1)
    tok = np.full(n, self.pad_id, np.int32)
    seg, pos, train = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, bool)
    tok[:used], seg[:used], pos[:used] = doc[:used], 1, np.arange(used)
    train[:used] = np.arange(used) >= train_from
    return {"tokens": tok, "tokens_segment_ids": seg, "tokens_positions": pos, "tokens_trainable": train}


def check(cfg: Config, sets: list[shards.TokenSet]) -> None:
  """Preference data and the DPO objective go together, one source at a time."""
  paired = [ts.name for ts in sets if ts.pairs]
  if cfg.train.objective != "dpo":
    if paired:
      raise UserError(f"data source {paired[0]!r} holds preference pairs: train it with train.objective=dpo, not "
                      f"train.objective={cfg.train.objective}")
    return
  if len(sets) != 1 or not paired:
    raise UserError(f"train.objective=dpo needs one source of preference data (data prepare --prompt-field "
                    f"--chosen-field --rejected-field); data.source={cfg.data.source!r} is not")
  _check_length(sets[0], cfg.train.seq_len)


def _check_length(ts: shards.TokenSet, seq_len: int) -> None:
  """A row keeps a sequence's first seq_len + 1 tokens, whose targets are positions 1..seq_len: a response starting
  past them trains nothing, and when every response does, every step would train nothing."""
  train_from, last = ts.index[:, 3], np.minimum(ts.lengths - 1, seq_len)
  if not (train_from <= last).any():
    need = int(train_from.min())
    raise UserError(f"train.seq_len={seq_len} cuts off every response of {ts.name!r} (each starts after its prompt, "
                    f"at token {need} at the earliest), so no step would train a token; set train.seq_len to at "
                    f"least {need}")
