"""The loader: sources -> packed rows -> a weighted mixture -> this process's batch slice.

The global batch of step s is a pure function of (train.seed, the data config, s): row j
of it comes from dataset c_j (drawn with the mixture weights from an RNG keyed by
(seed, s)), and is that dataset's next unused row (Packer.row). Every process computes
the same plan and loads only its own rows, so the iterator state is just the step (plus
the per-dataset row counts at that step, which make resuming O(1)); it means the same
on any number of processes. grain runs the batch builder in background threads and
prefetches (data.workers, data.prefetch).
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np

from jaxtrain.core.config import Config
from jaxtrain.data import readers, shards, tokenizer as tokenizer_lib
from jaxtrain.data.packing import Packer, fields_from_rows
from jaxtrain.core.errors import UserError
from jaxtrain.core.files import sha256_file

BUNDLED = Path(__file__).resolve().parent.parent / "corpus" / "bundled.jsonl"
SPLIT_SEED = 20240517  # which documents are held out; independent of train.seed on purpose
EVAL_SEED = 7  # eval rows are the same whatever train.seed is
MIX_TAG, STATE_VERSION = 0x4D4958, 1


def source_specs(spec: str) -> list[str]:
  return [s.strip() for s in spec.split(",") if s.strip()]


def _raw_path(spec: str) -> Path:
  return BUNDLED if spec == "bundled" else Path(spec)


class Source:
  """One opened data source: its documents and the tokenizer facts they were made with."""

  _memo: dict[tuple, "Source"] = {}
  _lock = threading.Lock()

  def __init__(self, tokens: shards.TokenSet, pad_id: int, vocab_size: int):
    self.tokens, self.pad_id, self.vocab_size = tokens, pad_id, vocab_size

  @classmethod
  def open(cls, spec: str, cfg: Config, check_tokenizer: bool = True) -> "Source":
    path, want = _raw_path(spec), cfg.data.tokenizer
    if path.is_dir():
      ts, manifest = shards.open_prepared(path, cfg.data.verify)
      tok = manifest["tokenizer"]
      if check_tokenizer and tok["digest"] != tokenizer_lib.digest_of(want):
        raise UserError(f"{spec!r} was prepared with tokenizer {tok['spec']!r} (digest {tok['digest']}) but "
                        f"data.tokenizer={want!r} has digest {tokenizer_lib.digest_of(want)}")
      return cls(ts, tok["pad_id"], tok["vocab_size"])
    if not path.is_file():
      raise UserError(f"data source {spec!r} does not exist; use 'bundled', a prepared directory, "
                      f"or a .txt, .jsonl or .parquet file")
    # A raw file is tokenized in memory with data.tokenizer (fine for small corpora).
    key = (str(path.resolve()), sha256_file(path), want, cfg.data.text_field)
    with cls._lock:
      if key not in cls._memo:
        tok = tokenizer_lib.load(want)
        docs = readers.read_documents(str(path), cfg.data.text_field)
        head = [] if tok.bos_id is None else [tok.bos_id]
        ids = [np.concatenate([head, b, [tok.eos_id]]) for b in tok.encode_batch(docs)]
        cls._memo[key] = cls(shards.in_memory(ids, spec), tok.pad_id, tok.vocab_size)
      return cls._memo[key]


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
      w = np.array([float(x) for x in cfg.data.weights.split(",")], np.float64)
    except ValueError:
      raise UserError(f"data.weights={cfg.data.weights!r} must be comma-separated numbers") from None
    if len(w) != len(sets) or (w <= 0).any():
      raise UserError(f"data.weights={cfg.data.weights!r} must hold {len(sets)} positive number(s), one per "
                      f"data source ({cfg.data.source!r})")
  return w / w.sum()


def open_sources(cfg: Config, check_tokenizer: bool = True):
  """(train TokenSets, eval TokenSets or None, pad id), after every user-facing check."""
  d = cfg.data
  specs = source_specs(d.source)
  if not specs:
    raise UserError("data.source is empty; use 'bundled', a prepared directory, or a file")
  sources = [Source.open(s, cfg, check_tokenizer) for s in specs]
  vocab = max(s.vocab_size for s in sources)
  if cfg.model.vocab_size < vocab:
    raise UserError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab} ids")
  train = [s.tokens for s in sources]
  held = None
  if d.eval_source.strip():
    if d.eval_fraction > 0:
      raise UserError("set data.eval_source or data.eval_fraction, not both")
    held = [Source.open(s, cfg, check_tokenizer).tokens for s in source_specs(d.eval_source)]
  elif d.eval_fraction > 0:
    if d.eval_fraction >= 1:
      raise UserError(f"data.eval_fraction={d.eval_fraction} must be below 1")
    train, held = map(list, zip(*[_split(ts, d.eval_fraction) for ts in train]))
  return train, held, sources[0].pad_id


class Mixture:
  """The global batch plan: for step s, which dataset and row each of the B rows is."""

  def __init__(self, sets, weights, seed: int, seq_len: int, batch_size: int, pad_id: int):
    self.packers = [Packer(ts, seq_len, seed, tag, pad_id) for tag, ts in enumerate(sets)]
    self.cum_weights = np.cumsum(weights)
    self.seed, self.B = seed, batch_size
    self._counts = {0: np.zeros(len(sets), np.int64)}  # rows taken from each dataset before step s
    self._lock = threading.Lock()

  def choices(self, step: int) -> np.ndarray:
    if len(self.packers) == 1:
      return np.zeros(self.B, np.int64)
    u = np.random.default_rng([self.seed, MIX_TAG, step]).random(self.B)
    return np.minimum(np.searchsorted(self.cum_weights, u, side="right"), len(self.packers) - 1)

  def counts(self, step: int) -> np.ndarray:
    """Rows taken from each dataset by steps < `step`, rolled forward from the nearest known step."""
    if len(self.packers) == 1:
      return np.array([step * self.B])
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

  def seed_counts(self, step: int, counts: list[int]) -> None:
    with self._lock:
      self._counts[step] = np.array(counts, np.int64)

  def batch(self, step: int, lo: int, hi: int) -> dict[str, np.ndarray]:
    """Rows lo..hi of the global batch of `step`."""
    ds = self.choices(step)
    rank = np.zeros(self.B, np.int64)  # index of row j among this step's rows from its dataset
    for d in np.unique(ds):
      rank[ds == d] = np.arange(int((ds == d).sum()))
    q = self.counts(step)[ds] + rank
    rows = [self.packers[ds[j]].row(int(q[j])) for j in range(lo, hi)]
    return fields_from_rows({k: np.stack([r[k] for r in rows]) for k in rows[0]})


class DataIterator:
  """This process's slice of each global batch. State: {"step", "rows_per_source"}."""

  def __init__(self, mixture: Mixture, lo: int, hi: int, workers: int, prefetch: int):
    self.mixture, self.lo, self.hi = mixture, lo, hi
    self.workers, self.prefetch = workers, prefetch
    self.step, self._it = 0, None

  def _start(self):
    import grain
    ds = grain.MapDataset.range(self.step, 1 << 62).map(lambda s: self.mixture.batch(s, self.lo, self.hi))
    self._it = iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=self.workers,
                                                         prefetch_buffer_size=self.prefetch)))

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self._it is None:
      self._start()
    batch = next(self._it)
    self.step += 1
    return batch

  def get_state(self) -> dict:
    return {"version": STATE_VERSION, "step": self.step,
            "rows_per_source": [int(c) for c in self.mixture.counts(self.step)]}

  def set_state(self, state: dict) -> None:
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or state["step"] < 0:
      raise UserError(f"data iterator state {state!r} has no valid 'step'")
    rows = state.get("rows_per_source")
    if rows is not None:
      if len(rows) != len(self.mixture.packers):
        raise UserError(f"data iterator state has {len(rows)} sources but data.source has "
                        f"{len(self.mixture.packers)}")
      self.mixture.seed_counts(state["step"], rows)
    self.close()
    self.step = state["step"]

  def close(self) -> None:
    if self._it is not None and hasattr(self._it, "close"):
      self._it.close()
    self._it = None


def _slice(cfg: Config, block: int, blocks: int) -> tuple[int, int]:
  B = cfg.train.batch_size
  if B % blocks:
    raise UserError(f"train.batch_size={B} must divide evenly into {blocks} blocks of rows")
  per = B // blocks
  return block * per, (block + 1) * per


def batches(cfg: Config, block: int = 0, blocks: int = 1, *, check_tokenizer: bool = True):
  """An iterator of rows block `block` of `blocks` of each global batch (numpy dicts), with
  get_state()/set_state()/close(). `placement.Placement.rows()` says which block a process feeds."""
  lo, hi = _slice(cfg, block, blocks)
  train, _, pad = open_sources(cfg, check_tokenizer)
  t = cfg.train
  mixture = Mixture(train, _weights(cfg, train), t.seed, t.seq_len, t.batch_size, pad)
  return DataIterator(mixture, lo, hi, cfg.data.workers, cfg.data.prefetch)


def eval_batches(cfg: Config, block: int = 0, blocks: int = 1) -> list[dict[str, np.ndarray]]:
  """The fixed held-out batches (rows block `block` of `blocks`, as for training): the first
  data.eval_batches global batches of the held-out split, the same at every evaluation."""
  lo, hi = _slice(cfg, block, blocks)
  _, held, pad = open_sources(cfg)
  if held is None:
    raise UserError(f"train.eval_interval={cfg.train.eval_interval} needs a held-out split: "
                    f"set data.eval_fraction or data.eval_source")
  t, n = cfg.train, cfg.data.eval_batches
  mixture = Mixture(held, _weights(cfg, held), EVAL_SEED, t.seq_len, t.batch_size, pad)
  have = sum(p.rows_per_epoch for p in mixture.packers)
  if have < n * t.batch_size:
    raise UserError(f"the held-out split has {have} rows of train.seq_len={t.seq_len}, fewer than "
                    f"data.eval_batches={n} x train.batch_size={t.batch_size}; lower data.eval_batches "
                    f"or hold out more data")
  return [mixture.batch(s, lo, hi) for s in range(n)]


def _digest_one(spec: str) -> str:
  path = _raw_path(spec)
  if path.is_dir():
    return hashlib.sha256((path / shards.MANIFEST).read_bytes()).hexdigest()[:16]
  if not path.is_file():
    raise UserError(f"data source {spec!r} does not exist")
  return sha256_file(path)[:16]


def source_digest(cfg: Config) -> str:
  """A short stable hash of the training data: the manifest of prepared data, the bytes of
  a raw file; for a mixture, a hash of the parts' hashes."""
  parts = [_digest_one(s) for s in source_specs(cfg.data.source)]
  return parts[0] if len(parts) == 1 else hashlib.sha256(",".join(parts).encode()).hexdigest()[:16]


def tokenizer_digest(cfg: Config) -> str:
  """A short stable hash of data.tokenizer."""
  return tokenizer_lib.digest_of(cfg.data.tokenizer)
