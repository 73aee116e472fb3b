"""The loader: sources -> packed rows -> a weighted mixture -> this process's slice of each batch. The global
batch of step s is a pure function of (train.seed, data config, s): the iterator state is the step."""

from __future__ import annotations

import functools
import hashlib
import json
import threading
import time
from pathlib import Path

import numpy as np

from jaxtrain.core import parse, ramp as ramp_lib
from jaxtrain.core.config import Config
from jaxtrain.data import busy, pairs, readers, shards, tokenizer as tokenizer_lib
from jaxtrain.core.errors import RunAborted, UserError
from jaxtrain.core.files import sha256_file

BUNDLED = Path(__file__).resolve().parent.parent / "corpus" / "bundled.jsonl"
SPLIT_SEED = 20240517  # which documents are held out; independent of train.seed on purpose
EVAL_SEED = 7  # eval rows are the same whatever train.seed is
# most_segments counts rows one by one in the orders of the first epochs: at least 2, at most EXACT_EPOCHS, and as
# many as hold EXACT_DOCS documents (about a second of work either way)
EXACT_DOCS, EXACT_EPOCHS = 50_000_000, 4096
MIX_TAG, STATE_VERSION = 0x4D4958, 1


class LoaderError(RunAborted):
  """The pipeline could not produce a training batch: one line naming the source and the step."""


class SourceError(Exception):
  """A row of one source could not be produced (raised in a loader thread; carries the source's name)."""

  def __init__(self, source: str, cause: BaseException):
    super().__init__(f"{type(cause).__name__}: {cause}")
    self.source = source


def source_specs(spec: str) -> list[str]:
  return parse.items(spec, "data.source")


def _raw_path(spec: str) -> Path:
  return BUNDLED if spec == "bundled" else Path(spec)


_memo, _lock = {}, threading.Lock()  # raw files tokenized in memory, by path, content, tokenizer, field


def open_source(spec: str, cfg: Config, check_tokenizer: bool = True) -> tuple[shards.TokenSet, int, int]:
  """One data source: (its documents, pad id, vocab size of the tokenizer that made them)."""
  path, want = _raw_path(spec), cfg.data.tokenizer
  if path.is_dir():
    ts, manifest = shards.open_prepared(path, cfg.data.verify)
    tok = manifest["tokenizer"]
    if check_tokenizer and tok["digest"] != tokenizer_lib.digest_of(want):
      raise UserError(f"{spec!r} was prepared with tokenizer {tok['spec']!r} (digest {tok['digest']}) but "
                      f"data.tokenizer={want!r} has digest {tokenizer_lib.digest_of(want)}")
    return ts, tok["pad_id"], tok["vocab_size"]
  if not path.is_file():
    raise UserError(f"data source {spec!r} does not exist; use 'bundled', a prepared directory, "
                    f"or a .txt, .jsonl or .parquet file")
  # A raw file is tokenized in memory with data.tokenizer (fine for small corpora).
  key = (str(path.resolve()), sha256_file(path), want, cfg.data.text_field)
  with _lock:
    if key not in _memo:
      tok = tokenizer_lib.load(want)
      bodies = tok.encode_batch(readers.read_documents(str(path), cfg.data.text_field))
      docs = [tokenizer_lib.frame(tok, b) for b in bodies]
      _memo[key] = shards.in_memory(docs, spec), tok.pad_id, tok.vocab_size
    return _memo[key]


def fields_from_rows(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Packed (N, seq_len+1) rows -> inputs, targets, loss mask (within one document, trainable), segments, positions."""
  tok, seg, pos = rows["tokens"], rows["tokens_segment_ids"], rows["tokens_positions"]
  valid = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
  if "tokens_trainable" in rows:
    valid &= rows["tokens_trainable"][:, 1:].astype(bool)
  return {"inputs": tok[:, :-1].astype(np.int32), "targets": tok[:, 1:].astype(np.int32),
          "loss_mask": valid.astype(np.int32), "segment_ids": seg[:, :-1].astype(np.int32),
          "positions": pos[:, :-1].astype(np.int32)}


class Packer:
  """Rows of one TokenSet. `row(q)` for q = epoch * rows_per_epoch + r, safe from threads."""

  def __init__(self, ts: shards.TokenSet, seq_len: int, seed: int, tag: int, pad_id: int = 0):
    if ts.n_tokens < 2:
      raise UserError(f"data source {ts.name!r} holds fewer than 2 tokens: nothing to train on")
    self.ts, self.L, self.seed, self.tag, self.pad_id = ts, seq_len, seed, tag, pad_id
    self.rows_per_epoch = -(-(ts.n_tokens - 1) // seq_len)
    self._layouts, self._lock = {}, threading.Lock()  # epoch -> (order, starts)

  def layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """The epoch's document order and the stream offset of each (cumulative lengths)."""
    with self._lock:
      if epoch not in self._layouts:
        if len(self._layouts) >= 2:  # keep the current epoch and the next
          self._layouts.pop(min(self._layouts))
        self._layouts[epoch] = self._new_layout(epoch)
      return self._layouts[epoch]

  def _new_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng([self.seed, self.tag, epoch]).permutation(self.ts.n_docs)
    return order, np.concatenate([[0], np.cumsum(self.ts.lengths[order])])

  def most_segments(self, rows: int) -> int:
    """The most segments (runs of one segment id, trailing padding included) in the inputs (the first L tokens)
    of rows 0..rows-1: counted in the orders of the first epochs (EXACT_DOCS), past them the most any order can
    give (the shortest documents side by side)."""
    L, total, most = self.L, self.ts.n_tokens, 1
    epochs, exact = -(-rows // self.rows_per_epoch), max(2, min(EXACT_EPOCHS, EXACT_DOCS // self.ts.n_docs))
    for epoch in range(min(epochs, exact)):
      starts = self._new_layout(epoch)[1]
      a = np.arange(min(rows - epoch * self.rows_per_epoch, self.rows_per_epoch), dtype=np.int64) * L
      last = np.minimum(a + L, total) - 1
      docs = np.searchsorted(starts, last, side="right") - np.searchsorted(starts, a, side="right") + 1
      most = max(most, int((docs + (a + L > total)).max()))
    if epochs > exact:  # k documents in L tokens: two ends of >= 1 token and the k - 2 shortest whole
      k = min(L, self.ts.n_docs)
      shortest = np.sort(np.partition(self.ts.lengths, k - 1)[:k])
      fit = 2 + int(np.searchsorted(np.cumsum(shortest), L - 2, "right"))
      most = max(most, min(L, min(self.ts.n_docs, fit) + 1))
    return most

  def row(self, q: int) -> dict[str, np.ndarray]:
    """One packed row of L + 1 tokens with segment ids, positions and trainable flags."""
    epoch, r = divmod(q, self.rows_per_epoch)
    order, starts = self.layout(epoch)
    a, n = r * self.L, self.L + 1
    b = min(a + n, int(starts[-1]))
    tok = np.full(n, self.pad_id, np.int32)
    seg, pos, train = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, bool)
    k = int(np.searchsorted(starts, a, side="right")) - 1
    for segment in range(1, len(order) - k + 1):  # the documents overlapping [a, b), numbered from 1
      if starts[k] >= b:
        break
      doc, train_from = self.ts.doc(order[k])
      lo, hi = max(a, starts[k]) - starts[k], min(b, starts[k + 1]) - starts[k]
      at = slice(starts[k] + lo - a, starts[k] + hi - a)
      tok[at], seg[at], pos[at], train[at] = doc[lo:hi], segment, np.arange(lo, hi), np.arange(lo, hi) >= train_from
      if (mask := self.ts.mask(order[k])) is not None:  # chat: only the assistant spans
        train[at] &= mask[lo:hi].astype(bool)
      k += 1
    return {"tokens": tok, "tokens_segment_ids": seg, "tokens_positions": pos, "tokens_trainable": train}


def packer(ts: shards.TokenSet, seq_len: int, seed: int, tag: int, pad_id: int = 0):
  """The rows of one source: packed documents, or preference pairs side by side (jaxtrain.data.pairs)."""
  return (pairs.PairPacker if ts.pairs else Packer)(ts, seq_len, seed, tag, pad_id)


def _split(ts: shards.TokenSet, fraction: float) -> tuple[shards.TokenSet, shards.TokenSet]:
  """(train, held-out): each document held out with probability `fraction` (fixed seed)."""
  held = np.random.default_rng(SPLIT_SEED).random(ts.n_docs) < fraction
  if held.all() or not held.any():
    raise UserError(f"data.eval_fraction={fraction} holds out {int(held.sum())} of the {ts.n_docs} documents of "
                    f"{ts.name!r}; it must leave at least one on each side")
  return ts.subset(~held), ts.subset(held)


def _weights(cfg: Config, sets: list[shards.TokenSet]) -> np.ndarray:
  if not cfg.data.weights.strip():
    w = np.array([s.n_tokens for s in sets], np.float64)  # no weights: proportional to tokens
  else:
    try:
      xs = parse.items(cfg.data.weights, "data.weights")
      if not all(x.isascii() for x in xs):  # float() would take full-width digits
        raise ValueError(cfg.data.weights)
      w = np.array([float(x) for x in xs], np.float64)
    except ValueError:
      raise UserError(f"data.weights={cfg.data.weights!r} must be comma-separated numbers") from None
    if len(w) != len(sets) or not (np.isfinite(w) & (w > 0)).all():
      raise UserError(f"data.weights={cfg.data.weights!r} must hold {len(sets)} positive number(s), one per "
                      f"data source ({cfg.data.source!r})")
  return w / w.sum()


def open_sources(cfg: Config, check_tokenizer: bool = True):
  """(train TokenSets, eval TokenSets or None, pad id), after every user-facing check."""
  d, specs = cfg.data, source_specs(cfg.data.source)
  if not specs:
    raise UserError("data.source is empty; use 'bundled', a prepared directory, or a file")
  sources = [open_source(s, cfg, check_tokenizer) for s in specs]
  vocab = max(v for _, _, v in sources)
  if cfg.model.vocab_size < vocab:
    raise UserError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab} ids")
  train, held = [ts for ts, _, _ in sources], None
  if d.eval_source.strip():
    if d.eval_fraction > 0:
      raise UserError("set data.eval_source or data.eval_fraction, not both")
    held = [open_source(s, cfg, check_tokenizer)[0] for s in source_specs(d.eval_source)]
  elif d.eval_fraction > 0:
    if d.eval_fraction >= 1:
      raise UserError(f"data.eval_fraction={d.eval_fraction} must be below 1")
    train, held = map(list, zip(*[_split(ts, d.eval_fraction) for ts in train]))
  return train, held, sources[0][1]


class Mixture:
  """The global batch plan: for step s, which dataset and row each of its B_s rows is (B_s: train.batch_ramp's size
  of step s, else train.batch_size): one stream of rows cut into steps, the same on every mesh."""

  def __init__(self, cfg: Config, sets: list[shards.TokenSet], seed: int, pad_id: int, ramp: bool = True):
    self.cum_weights, self.seed, self.B = np.cumsum(_weights(cfg, sets)), seed, cfg.train.batch_size
    t = cfg.train
    self.ramp = ramp_lib.of(cfg) if ramp else ramp_lib.build("", t.batch_size, t.seq_len)
    self.packers = [packer(ts, cfg.train.seq_len, seed, tag, pad_id) for tag, ts in enumerate(sets)]
    self._counts, self._lock = {0: np.zeros(len(sets), np.int64)}, threading.Lock()  # step -> rows taken before

  def choices(self, step: int) -> np.ndarray:
    u = np.random.default_rng([self.seed, MIX_TAG, step]).random(self.ramp.size(step))
    return np.minimum(np.searchsorted(self.cum_weights, u, side="right"), len(self.packers) - 1)

  def counts(self, step: int) -> np.ndarray:
    """Rows taken from each dataset by steps < `step`, rolled forward from the nearest known step."""
    if len(self.packers) == 1:
      return np.array([self.ramp.rows_before(step)])
    with self._lock:
      known = max(s for s in self._counts if s <= step)
      c = self._counts[known].copy()
      for s in range(known, step):
        c += np.bincount(self.choices(s), minlength=len(self.packers))
        if (s + 1) % 64 == 0 or s + 1 == step:
          self._counts[s + 1] = c.copy()
      if len(self._counts) > 256:
        for s in sorted(self._counts)[1:-128]:
          del self._counts[s]
      return c

  def batch(self, step: int, lo: int, hi: int, before_row=None) -> dict[str, np.ndarray]:
    """Rows lo..hi of the global batch of `step`; `before_row()` (a fault hook) runs before each row is read."""
    ds = self.choices(step)
    rank = np.zeros(len(ds), np.int64)  # index of row j among this step's rows from its dataset
    for d in np.unique(ds):
      rank[ds == d] = np.arange(int((ds == d).sum()))
    q = self.counts(step)[ds] + rank
    rows = [self._row(self.packers[ds[j]], int(q[j]), before_row) for j in range(lo, hi)]
    return fields_from_rows({k: np.stack([r[k] for r in rows]) for k in rows[0]})

  @staticmethod
  def _row(packer: Packer, q: int, before=None) -> dict[str, np.ndarray]:
    try:
      if before is not None:
        before()
      return packer.row(q)
    except Exception as e:  # noqa: BLE001 (a read error, a bug in a transform: the line names the source)
      raise SourceError(packer.ts.name, e) from e


class DataIterator:
  """This process's slice (block `block` of `blocks`) of each global batch. State: {"step", "rows_per_source"}."""

  def __init__(self, mixture: Mixture, block: int, blocks: int, workers: int, prefetch: int):
    self.mixture, self.block, self.blocks, self.workers, self.prefetch = mixture, block, blocks, workers, prefetch
    self.step, self._it = 0, None
    self.busy = busy.BusyClock()  # the loader's own rate (the run's checklist)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    """The next batch; a failure is a LoaderError naming the source and the training step (self.step + 1), and
    leaves the state at the failed batch, so a checkpoint taken now makes the rerun fetch it again."""
    if self._it is None:  # grain builds batches from self.step on in background threads
      import grain
      from jaxtrain.run import faults
      ds = grain.MapDataset.range(self.step, 1 << 62).map(lambda s: self.busy.timed(
          self.mixture.batch, s, *self.rows(s), functools.partial(faults.loader_read, s + 1)))
      options = grain.ReadOptions(num_threads=self.workers, prefetch_buffer_size=self.prefetch)
      self._it = iter(ds.to_iter_dataset(options))
    try:
      batch = next(self._it)
    except Exception as e:  # noqa: BLE001 (one line for the terminal; the traceback goes to the run's log)
      self.close()  # a failed grain iterator is not resumed: a retry starts a new one at self.step
      where, why = (f"data source {e.source!r}", e) if isinstance(e, SourceError) else (
          "data.source " + ", ".join(repr(p.ts.name) for p in self.mixture.packers), f"{type(e).__name__}: {e}")
      raise LoaderError(f"the data pipeline failed on the batch of step {self.step + 1} ({where}): {why}") from e
    self.step += 1
    return batch

  def rows(self, step: int) -> tuple[int, int]:
    """This process's rows [lo, hi) of step `step`'s global batch."""
    per = self.mixture.ramp.size(step) // self.blocks
    return self.block * per, (self.block + 1) * per

  def get_state(self) -> dict:
    return {"version": STATE_VERSION, "step": self.step,
            "rows_per_source": [int(c) for c in self.mixture.counts(self.step)]}

  def set_state(self, state: dict) -> None:
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or state["step"] < 0:
      raise UserError(f"data iterator state {state!r} has no valid 'step'")
    rows = state.get("rows_per_source")
    if rows is not None:
      if len(rows) != len(self.mixture.packers):
        raise UserError(f"data iterator state has {len(rows)} sources but data.source has {len(self.mixture.packers)}")
      with self.mixture._lock:
        self.mixture._counts[state["step"]] = np.array(rows, np.int64)
    self.close()
    self.step = state["step"]

  def close(self) -> None:
    getattr(self._it, "close", lambda: None)()
    self._it = None


def _slice(cfg: Config, block: int, blocks: int) -> tuple[int, int]:
  per, rest = divmod(cfg.train.batch_size, blocks)
  if rest:
    raise UserError(f"train.batch_size={cfg.train.batch_size} must divide evenly into {blocks} blocks of rows")
  return block * per, (block + 1) * per


def batches(cfg: Config, block: int = 0, blocks: int = 1, *, check_tokenizer: bool = True):
  """Rows block `block` of `blocks` of each global batch (numpy dicts), with get_state()/set_state()/close()."""
  _slice(cfg, block, blocks)  # each ramp size divides like the largest (step.check_fits_mesh)
  train, _, pad = open_sources(cfg, check_tokenizer)
  pairs.check(cfg, train)
  return DataIterator(Mixture(cfg, train, cfg.train.seed, pad), block, blocks, cfg.data.workers, cfg.data.prefetch)


def most_segments(cfg: Config, steps: int) -> int:
  """The most segments (documents, and a run of trailing padding) a row of the first `steps` training batches or
  of the eval batches holds: what the attention kernel must handle (jaxtrain.parallel.kernels). In a mixture every
  source is counted as if it gave all the rows."""
  train, held, pad = open_sources(cfg, check_tokenizer=False)
  t = cfg.train
  parts = [(train, t.seed, ramp_lib.of(cfg).rows_before(steps))]
  if held is not None:
    parts.append((held, EVAL_SEED, cfg.data.eval_batches * t.batch_size))
  return max(packer(ts, t.seq_len, seed, tag, pad).most_segments(rows)
             for sets, seed, rows in parts for tag, ts in enumerate(sets))


def eval_batches(cfg: Config, block: int = 0, blocks: int = 1) -> list[dict[str, np.ndarray]]:
  """The first data.eval_batches held-out global batches (rows block `block` of `blocks`), fixed across evals."""
  lo, hi = _slice(cfg, block, blocks)
  _, held, pad = open_sources(cfg)
  if held is None:
    raise UserError(f"train.eval_interval={cfg.train.eval_interval} needs a held-out split: "
                    f"set data.eval_fraction or data.eval_source")
  t, n = cfg.train, cfg.data.eval_batches
  mixture = Mixture(cfg, held, EVAL_SEED, pad, ramp=False)  # eval batches: train.batch_size rows
  have = sum(p.rows_per_epoch for p in mixture.packers)
  if have < n * t.batch_size:
    raise UserError(f"the held-out split has {have} rows of train.seq_len={t.seq_len}, fewer than "
                    f"data.eval_batches={n} x train.batch_size={t.batch_size}; lower data.eval_batches "
                    f"or hold out more data")
  return [mixture.batch(s, lo, hi) for s in range(n)]


def _digest_one(spec: str) -> str:
  path = _raw_path(spec)
  if path.is_dir():
    shards.read_manifest(path)  # one line, not a traceback, for a directory that is not a prepared dataset
    return hashlib.sha256((path / shards.MANIFEST).read_bytes()).hexdigest()[:16]
  if not path.is_file():
    raise UserError(f"data source {spec!r} does not exist")
  return sha256_file(path)[:16]


def source_digest(cfg: Config) -> str:
  """A short stable hash of the training data (manifest, raw bytes, or for a mixture the parts' hashes)."""
  parts = [_digest_one(s) for s in source_specs(cfg.data.source)]
  return parts[0] if len(parts) == 1 else hashlib.sha256(",".join(parts).encode()).hexdigest()[:16]


def tokenizer_digest(cfg: Config) -> str:
  """A short stable hash of data.tokenizer."""
  return tokenizer_lib.digest_of(cfg.data.tokenizer)


def bench(cfg: Config, n: int) -> dict:
  """Tokens/s the loader delivers over `n` batches after one warm-up batch; printed and returned."""
  it = batches(cfg, check_tokenizer=False)  # measures the loader, whatever tokenizer made the data
  next(it)  # opens, verifies and starts the workers
  t0 = time.perf_counter()
  valid = sum(int(next(it)["loss_mask"].sum()) for _ in range(n))
  seconds = time.perf_counter() - t0
  it.close()
  t, d = cfg.train, cfg.data
  out = {"batches": n, "batch_size": t.batch_size, "seq_len": t.seq_len, "workers": d.workers,
         "prefetch": d.prefetch, "seconds": seconds, "tokens_per_sec": n * t.batch_size * t.seq_len / seconds,
         "valid_tokens_per_sec": valid / seconds}
  print(f"bench: {n} batches of {t.batch_size} x {t.seq_len} in {seconds:.3f}s: "
        f"{out['tokens_per_sec']:,.0f} tokens/s ({out['valid_tokens_per_sec']:,.0f} valid tokens/s) "
        f"with data.workers={d.workers}, data.prefetch={d.prefetch}")
  print(json.dumps(out))
  return out
