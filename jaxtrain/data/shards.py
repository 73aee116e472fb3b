"""The prepared-data format: token shards as memory-mapped .npy arrays plus a manifest.

A prepared dataset is a directory:
  manifest.json            tokenizer, sources, counts, and every shard file with size and sha256
  shard-00000.tokens.npy   all documents of the shard, concatenated (uint16, or uint32 if the
                           vocabulary needs it); each document is [BOS] body EOS
  shard-00000.index.npy    int64 (documents, 3): start, length, first trainable token
  shard-00000.json         written last: the shard is complete (lets `prepare` resume)

Loading memory-maps the token files, so reading a document is a slice: random access at
page-cache speed, no decoding, no per-record framing. A TokenSet is the union of the
shards' document index; the in-memory corpora ('bundled', raw files) are TokenSets too.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np

from jaxtrain.run import filecheck
from jaxtrain.core import files
from jaxtrain.core.errors import UserError

FORMAT = "jaxtrain-tokens-v1"
MANIFEST = "manifest.json"
SHARD, START, LEN, TRAIN_FROM = range(4)  # columns of TokenSet.index


def shard_files(n: int) -> dict[str, str]:
  return {"tokens": f"shard-{n:05d}.tokens.npy", "index": f"shard-{n:05d}.index.npy"}


def token_dtype(vocab_size: int):
  return np.uint16 if vocab_size <= 1 << 16 else np.uint32


class TokenSet:
  """Documents as slices of token arrays. index: int64 (docs, 4) = shard, start, length,
  first trainable token (1 for plain text: BOS or the first token is never a target;
  after the prompt for supervised data)."""

  def __init__(self, arrays: list[np.ndarray], index: np.ndarray, name: str):
    self.arrays, self.index, self.name = arrays, index, name
    self.lengths = index[:, LEN]
    self.n_docs = len(index)
    self.n_tokens = int(self.lengths.sum())

  def subset(self, keep: np.ndarray) -> "TokenSet":
    return TokenSet(self.arrays, self.index[keep], self.name)

  def doc(self, i: int) -> tuple[np.ndarray, int]:
    shard, start, length, train_from = self.index[i]
    return self.arrays[shard][start:start + length], int(train_from)


def in_memory(docs: list[np.ndarray], name: str, train_from: list[int] | None = None) -> TokenSet:
  """A TokenSet over already-tokenized documents (each [BOS] body EOS)."""
  lengths = np.array([len(d) for d in docs], np.int64)
  index = np.zeros((len(docs), 4), np.int64)
  index[:, START] = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(docs) else 0
  index[:, LEN] = lengths
  index[:, TRAIN_FROM] = 1 if train_from is None else np.maximum(1, train_from)
  tokens = np.concatenate(docs).astype(np.int32) if docs else np.zeros(0, np.int32)
  return TokenSet([tokens], index, name)


def read_manifest(directory: Path) -> dict:
  path = directory / MANIFEST
  if not path.is_file():
    raise UserError(f"{str(directory)!r} has no {MANIFEST}: not a prepared dataset "
                    f"(make one with `python -m jaxtrain.data prepare`)")
  try:
    manifest = json.loads(path.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise UserError(f"{path}: not a valid manifest ({e})") from None
  if manifest.get("format") != FORMAT:
    raise UserError(f"{path}: format {manifest.get('format')!r} is not {FORMAT!r}")
  return manifest


def check_file(directory: Path, entry: dict, verify: bool) -> Path:
  """A shard file exists with the manifest's size (and sha256 when `verify`), else a UserError."""
  problem = _problem(directory, entry, verify)
  if problem is not None:
    raise UserError(problem)
  return directory / entry["name"]


def _problem(directory: Path, entry: dict, verify: bool) -> str | None:
  path = directory / entry["name"]
  if not path.is_file():
    return f"shard {path} is missing (listed in {directory / MANIFEST})"
  if path.stat().st_size != entry["bytes"]:
    return f"shard {path} has {path.stat().st_size} bytes but the manifest says {entry['bytes']}"
  if verify and files.sha256_file(path) != entry["sha256"]:
    return f"shard {path}: sha256 does not match the manifest (corrupt or replaced; re-run prepare)"
  return None


_opened: dict[tuple, TokenSet] = {}
_lock = threading.Lock()


def open_prepared(directory: Path, verify: bool = True) -> tuple[TokenSet, dict]:
  """Memory-maps a prepared dataset after checking its shards against the manifest.
  Verified once per process while the manifest and the shard files' stat are unchanged."""
  manifest = read_manifest(directory)
  stats = []
  for shard in manifest["shards"]:
    for entry in shard["files"].values():
      p = directory / entry["name"]
      stats.append((p.stat().st_mtime_ns, p.stat().st_size) if p.exists() else None)
  key = (str(directory.resolve()), (directory / MANIFEST).read_bytes(), verify, tuple(stats))
  with _lock:
    if key in _opened:
      return _opened[key], manifest
  if verify and filecheck.processes()[0] > 1:
    # Several processes: each hashes its share of the shards and all stop on the same one.
    entries = [entry for shard in manifest["shards"] for entry in shard["files"].values()]
    problem = filecheck.first_problem([e["bytes"] for e in entries],
                                      lambda i: _problem(directory, entries[i], True))
    if problem is not None:
      raise UserError(problem)
    verify = False  # what is left below is the cheap size check
  arrays, parts = [], []
  for n, shard in enumerate(manifest["shards"]):
    tokens = np.load(check_file(directory, shard["files"]["tokens"], verify), mmap_mode="r")
    index = np.load(check_file(directory, shard["files"]["index"], verify))
    if len(index) != shard["documents"] or len(tokens) != shard["tokens"]:
      raise UserError(f"shard {directory / shard['files']['tokens']['name']}: counts differ from the manifest")
    arrays.append(tokens)
    parts.append(np.concatenate([np.full((len(index), 1), n, np.int64), index], axis=1))
  index = np.concatenate(parts) if parts else np.zeros((0, 4), np.int64)
  ts = TokenSet(arrays, index, str(directory))
  with _lock:
    _opened[key] = ts
  return ts, manifest
