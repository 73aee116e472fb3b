"""The prepared-data format: memory-mapped .npy token shards plus manifest.json (docs/data.md, "Prepared format")."""

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


class TokenSet:
  """Documents as slices of token arrays. index: int64 (docs, 4) = shard, start, length, first trainable token."""

  def __init__(self, arrays: list[np.ndarray], index: np.ndarray, name: str):
    self.arrays, self.index, self.name = arrays, index, name
    self.lengths, self.n_docs = index[:, 2], len(index)
    self.n_tokens = int(self.lengths.sum())

  def doc(self, i: int) -> tuple[np.ndarray, int]:
    shard, start, length, train_from = self.index[i]
    return self.arrays[shard][start:start + length], int(train_from)


def concat(docs: list[np.ndarray], train_from: list[int]) -> tuple[np.ndarray, np.ndarray]:
  """Documents -> their tokens concatenated and an int64 (docs, 3) index: start, length, first trainable."""
  lengths = np.array([len(d) for d in docs], np.int64)
  index = np.stack([np.cumsum(lengths) - lengths, lengths, np.array(train_from, np.int64)], axis=1)
  return (np.concatenate(docs) if docs else np.zeros(0, np.int32)), index.reshape(-1, 3)


def in_memory(docs: list[np.ndarray], name: str) -> TokenSet:
  """A TokenSet over already-tokenized plain-text documents (each [BOS] body EOS)."""
  tokens, index = concat(docs, [1] * len(docs))
  return TokenSet([tokens.astype(np.int32)], np.concatenate([np.zeros((len(docs), 1), np.int64), index], 1), name)


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


def problem(directory: Path, entry: dict, verify: bool) -> str | None:
  """Why a shard file does not match its manifest entry (size; sha256 when `verify`), or None."""
  path = directory / entry["name"]
  if not path.is_file():
    return f"shard {path} is missing (listed in {directory / MANIFEST})"
  if path.stat().st_size != entry["bytes"]:
    return f"shard {path} has {path.stat().st_size} bytes but the manifest says {entry['bytes']}"
  if verify and files.sha256_file(path) != entry["sha256"]:
    return f"shard {path}: sha256 does not match the manifest (corrupt or replaced; re-run prepare)"
  return None


_opened, _lock = {}, threading.Lock()  # verified datasets, by manifest and shard files' stat


def open_prepared(directory: Path, verify: bool = True) -> tuple[TokenSet, dict]:
  """Memory-maps a prepared dataset checked against its manifest (once while manifest and shard stats hold)."""
  manifest = read_manifest(directory)
  entries = [entry for shard in manifest["shards"] for entry in shard["files"].values()]
  stats = [(p.stat().st_mtime_ns, p.stat().st_size) if p.exists() else None
           for p in (directory / e["name"] for e in entries)]
  key = (str(directory.resolve()), (directory / MANIFEST).read_bytes(), verify, tuple(stats))
  with _lock:
    if key in _opened:
      return _opened[key], manifest
  if verify and filecheck.processes()[0] > 1:
    # Several processes: each hashes its share of the shards and all stop on the same one.
    if (first := filecheck.first_problem([e["bytes"] for e in entries],
                                         lambda i: problem(directory, entries[i], True))) is not None:
      raise UserError(first)
    verify = False  # what is left below is the cheap size check
  arrays, parts = [], []
  for n, shard in enumerate(manifest["shards"]):
    for entry in shard["files"].values():
      if (why := problem(directory, entry, verify)) is not None:
        raise UserError(why)
    tokens = np.load(directory / shard["files"]["tokens"]["name"], mmap_mode="r")
    index = np.load(directory / shard["files"]["index"]["name"])
    if len(index) != shard["documents"] or len(tokens) != shard["tokens"]:
      raise UserError(f"shard {directory / shard['files']['tokens']['name']}: counts differ from the manifest")
    arrays.append(tokens)
    parts.append(np.concatenate([np.full((len(index), 1), n, np.int64), index], axis=1))
  index = np.concatenate(parts) if parts else np.zeros((0, 4), np.int64)
  ts = TokenSet(arrays, index, str(directory))
  with _lock:
    _opened[key] = ts
  return ts, manifest
