"""Minimal data: a byte-level tokenizer, the bundled corpus, and a grain packing pipeline.

A global batch is a function of (seed, data source, step) alone: every process builds
the same stream of packed rows and keeps its own contiguous slice of each global batch.
(Reading only that slice from storage is the later real-data work.)

Each packed row holds seq_len + 1 tokens; inputs are row[:-1] and targets row[1:]. A
target counts in the loss only when it continues the same document (segment id equal
and non-zero), so documents never predict across their boundary or into padding.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from jaxtrain.config import Config
from jaxtrain.errors import UserError

BUNDLED = Path(__file__).resolve().parent / "corpus" / "bundled.jsonl"


class ByteTokenizer:
  """UTF-8 bytes shifted past three specials: PAD=0, BOS=1, EOS=2."""

  PAD, BOS, EOS, OFFSET = 0, 1, 2, 3
  vocab_size = 256 + OFFSET
  digest = hashlib.sha256(b"jaxtrain-byte-tokenizer-v1").hexdigest()[:16]

  def encode(self, text: str) -> np.ndarray:
    body = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + self.OFFSET
    return np.concatenate([[self.BOS], body, [self.EOS]]).astype(np.int32)

  def decode(self, ids) -> str:
    data = bytes(int(i) - self.OFFSET for i in ids if int(i) >= self.OFFSET)
    return data.decode("utf-8", errors="replace")


def read_documents(source: str, text_field: str = "text") -> list[str]:
  """Texts of a .jsonl file (one document per line) or a .txt file (blank-line separated)."""
  path = BUNDLED if source == "bundled" else Path(source)
  if not path.is_file():
    raise UserError(f"data.source={source!r} is not a file; use 'bundled' or a path to a .txt or .jsonl file")
  if path.suffix == ".jsonl":
    docs = []
    with path.open() as f:
      for n, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          docs.append(json.loads(line)[text_field])
        except (json.JSONDecodeError, KeyError, TypeError):
          raise UserError(f"{path}:{n}: not a JSON object with a {text_field!r} field (data.text_field)") from None
  elif path.suffix == ".txt":
    docs = [d.strip() for d in path.read_text().split("\n\n")]
  else:
    raise UserError(f"data.source={source!r}: unsupported file type {path.suffix!r}; use .txt or .jsonl")
  docs = [d for d in docs if d]
  if not docs:
    raise UserError(f"data.source={source!r} holds no documents")
  return docs


def fields_from_rows(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Packed (N, seq_len+1) rows -> model inputs, targets, loss mask, segment ids, positions."""
  tok, seg, pos = rows["tokens"], rows["tokens_segment_ids"], rows["tokens_positions"]
  valid = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
  return {
      "inputs": tok[:, :-1].astype(np.int32),
      "targets": tok[:, 1:].astype(np.int32),
      "loss_mask": valid.astype(np.int32),
      "segment_ids": seg[:, :-1].astype(np.int32),
      "positions": pos[:, :-1].astype(np.int32),
  }


def batches(cfg: Config, process_index: int = 0, process_count: int = 1):
  """An iterator of this process's slice of each global batch (numpy dicts)."""
  import grain

  t = cfg.train
  tok = ByteTokenizer()
  if cfg.model.vocab_size < tok.vocab_size:
    raise UserError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {tok.vocab_size} ids")
  if t.batch_size % process_count:
    raise UserError(f"train.batch_size={t.batch_size} must divide evenly over {process_count} processes")
  docs = read_documents(cfg.data.source, cfg.data.text_field)
  per_process = t.batch_size // process_count
  lo = process_index * per_process
  # Reshuffled every epoch (shuffle, then an endless repeat).
  ds = (grain.MapDataset.source(docs).shuffle(seed=t.seed).repeat(None)
        .map(lambda text: {"tokens": tok.encode(text)}).to_iter_dataset())
  ds = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct={"tokens": t.seq_len + 1})
  ds = ds.batch(t.batch_size).map(lambda rows: fields_from_rows({k: v[lo:lo + per_process] for k, v in rows.items()}))
  ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=2)
  return iter(ds)


def source_digest(cfg: Config) -> str:
  path = BUNDLED if cfg.data.source == "bundled" else Path(cfg.data.source)
  return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
