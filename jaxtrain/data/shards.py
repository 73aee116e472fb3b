"""The prepared-data format: memory-mapped .npy token shards plus manifest.json (docs/data.md, "Prepared format")."""

from __future__ import annotations

import collections
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
  """Documents as slices of token arrays. index: int64 (docs, 4) = shard, start, length, first trainable token.
  `masks` (chat data): per shard, one flag per token, 1 where that token is trained on as a target."""

  def __init__(self, arrays: list[np.ndarray], index: np.ndarray, name: str, masks: list[np.ndarray] | None = None,
               pairs: bool = False):
    self.arrays, self.index, self.name, self.masks = arrays, index, name, masks
    self.pairs = pairs  # preference data: documents 2i and 2i + 1 are the chosen and rejected responses of pair i
    self.lengths, self.n_docs = index[:, 2], len(index)
    self.n_tokens = int(self.lengths.sum())

  def doc(self, i: int) -> tuple[np.ndarray, int]:
    shard, start, length, train_from = self.index[i]
    return self.arrays[shard][start:start + length], int(train_from)

  def mask(self, i: int) -> np.ndarray | None:
    """Document i's per-token trainable flags, or None where the first trainable token alone says it."""
    if self.masks is None:
      return None
    shard, start, length, _ = self.index[i]
    return self.masks[shard][start:start + length]

  def subset(self, rows: np.ndarray) -> "TokenSet":
    if self.pairs:
      raise UserError(f"{self.name!r} holds preference pairs, which a held-out split by document would separate")
    return TokenSet(self.arrays, self.index[rows], self.name, self.masks)


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
  if not isinstance(manifest, dict):
    raise UserError(f"{path}: not a valid manifest (a JSON {_kind(manifest)}, not an object)")
  if manifest.get("format") != FORMAT:
    raise UserError(f"{path}: format {manifest.get('format')!r} is not {FORMAT!r}")
  if (why := _malformed(manifest)) is not None:
    raise UserError(f"{path}: not a valid manifest ({why}; re-run prepare)")
  return manifest


def _kind(value) -> str:
  return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
      type(value), "number")


def _want(obj, key, kind, where, check=lambda v: True) -> str | None:
  """Why obj[key] is not a `kind` that passes `check` (a JSON bool is no int), or None."""
  if not isinstance(obj, dict) or key not in obj:
    return f"{where}: no {key!r}"
  v = obj[key]
  if not isinstance(v, kind) or (isinstance(v, bool) and kind is int) or not check(v):
    return f"{where}.{key} is a JSON {_kind(v)}" if isinstance(v, (dict, list)) else f"{where}.{key} is {v!r}"
  return None


def _shard_malformed(shard, at: str) -> str | None:
  if not isinstance(shard, dict):
    return f"{at} is {shard!r}, not an object"
  counted = lambda v: v >= 0  # noqa: E731
  why = (_want(shard, "documents", int, at, counted) or _want(shard, "tokens", int, at, counted)
         or _want(shard, "files", dict, at))
  if why is not None:
    return why
  for key in ("tokens", "index", *(k for k in shard["files"] if k not in ("tokens", "index"))):
    here = f"{at}.files.{key}"
    entry = shard["files"].get(key)
    why = (_want(shard["files"], key, dict, f"{at}.files") or _want(entry, "bytes", int, here, counted)
           or _want(entry, "sha256", str, here)  # a bare file name: nothing outside the directory
           or _want(entry, "name", str, here, lambda v: v not in ("", ".", "..") and Path(v).name == v))
    if why is not None:
      return why
  return None


def _malformed(manifest: dict) -> str | None:
  """What the loader needs of a manifest and it lacks (key, type, consistent totals), or None."""
  tok = manifest.get("tokenizer")
  why = (_want(manifest, "tokenizer", dict, "manifest") or _want(tok, "digest", str, "tokenizer")
         or _want(tok, "spec", str, "tokenizer") or _want(tok, "vocab_size", int, "tokenizer", lambda v: v > 0)
         or _want(tok, "pad_id", int, "tokenizer", lambda v: 0 <= v < tok["vocab_size"])
         or _want(manifest, "shards", list, "manifest"))
  for n, shard in enumerate(manifest["shards"] if why is None else ()):
    why = why or _shard_malformed(shard, f"shards[{n}]")
  if why is not None:
    return why
  names = collections.Counter(e["name"] for shard in manifest["shards"] for e in shard["files"].values())
  if twice := [name for name, k in names.items() if k > 1]:
    return f"shard file {twice[0]!r} is listed twice"
  for key in ("documents", "tokens"):  # a shard left out of the list shows here
    total = sum(shard[key] for shard in manifest["shards"])
    if why := _want(manifest, key, int, "manifest", lambda v: v == total):
      return f"{why}, but its shards hold {total} {key}"
  return None


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


def _arrays(directory: Path, shard: dict) -> tuple[np.ndarray, np.ndarray]:
  """A shard's token array (memory-mapped) and index, each checked to be a readable integer .npy of its shape."""
  out = []
  for key, ndim in (("tokens", 1), ("index", 2)):
    path = directory / shard["files"][key]["name"]
    try:
      array = np.load(path, mmap_mode="r" if key == "tokens" else None, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
      raise UserError(f"shard {path}: not a readable .npy file ({str(e).splitlines()[0] if str(e) else e!r}; "
                      "re-run prepare)") from None
    if array.ndim != ndim or not np.issubdtype(array.dtype, np.integer) or key == "index" and array.shape[1] != 3:
      want = "1-D integer token ids" if key == "tokens" else "int64 (documents, 3) rows"
      raise UserError(f"shard {path}: a {array.dtype} array of shape {array.shape}, not {want} (re-run prepare)")
    out.append(array)
  return out[0], out[1]


def index_problem(path: Path, n_tokens: int, index: np.ndarray) -> str | None:
  """Why an index (start, length, first trainable) does not describe documents stored back to back in the
  n_tokens tokens of its shard (each starting where the one before ends), or None."""
  start, length, train_from = (index[:, k].astype(np.int64) for k in range(3))
  end = np.concatenate([[0], np.cumsum(length)])  # where each row must start, given the lengths
  checks = [
      (length < 0, lambda i: f"length {length[i]} is negative"),
      (start + length > n_tokens, lambda i: f"(start {start[i]}, length {length[i]}) ends at token "
                                            f"{start[i] + length[i]}, past the end of the shard's {n_tokens} tokens"),
      (start != end[:-1], lambda i: f"start {start[i]} is not where row {i - 1} ends ({end[i]}): rows must be in "
                                    f"order, without gaps or overlap" if i else f"start {start[i]} is not 0"),
      ((train_from < 0) | (train_from > length), lambda i: f"first trainable token {train_from[i]} is outside its "
                                                           f"{length[i]} tokens"),
  ]
  bad = [(int(np.argmax(mask)), text) for mask, text in checks if mask.any()]
  if bad:
    i, text = min(bad, key=lambda b: b[0])
    return f"shard index {path}: row {i} {text(i)} (re-run prepare)"
  if end[-1] != n_tokens:
    return f"shard index {path}: its rows cover {end[-1]} of the shard's {n_tokens} tokens (re-run prepare)"
  return None


def ids_problem(path: Path, tokens: np.ndarray, index: np.ndarray, vocab_size: int,
                chunk: int = 1 << 24) -> str | None:
  """The first token id outside [0, vocab_size) with its offset and index row, or None; read in chunks."""
  for a in range(0, len(tokens), chunk):
    part = np.asarray(tokens[a:a + chunk])
    if part.size and (int(part.min()) < 0 or int(part.max()) >= vocab_size):
      at = a + int(np.argmax((part < 0) | (part >= vocab_size)))
      row = int(np.searchsorted(index[:, 0], at, side="right")) - 1
      return (f"shard {path}: token id {int(tokens[at])} at offset {at} (index row {row}) is outside the "
              f"tokenizer's vocabulary of {vocab_size} ids (corrupt or replaced; re-run prepare)")
  return None


def mask_of(directory: Path, shard: dict, n_tokens: int) -> np.ndarray | None:
  """A chat shard's per-token mask (memory-mapped; checked to be 0/1 flags, one per token), or None."""
  if "mask" not in shard["files"]:
    return None
  path = directory / shard["files"]["mask"]["name"]
  try:
    mask = np.load(path, mmap_mode="r", allow_pickle=False)
  except (OSError, ValueError, EOFError) as e:
    raise UserError(f"shard {path}: not a readable .npy file ({e}; re-run prepare)") from None
  if mask.dtype != np.uint8 or mask.shape != (n_tokens,) or (n_tokens and int(np.max(mask)) > 1):
    raise UserError(f"shard {path}: a {mask.dtype} array of shape {mask.shape}, not {n_tokens} 0/1 uint8 flags "
                    "(re-run prepare)")
  return mask


def checked(directory: Path, shard: dict, verify: bool, vocab_size: int,
            ids: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
  """A shard's tokens (memory-mapped) and index; a UserError where they do not match the manifest entry or hold
  what prepare never writes. Sizes and the index always; with `verify`, digests and (unless `ids` says otherwise)
  every token id against the vocabulary too."""
  for entry in shard["files"].values():
    if (why := problem(directory, entry, verify)) is not None:
      raise UserError(why)
  tokens, index = _arrays(directory, shard)
  path = directory / shard["files"]["tokens"]["name"]
  if len(index) != shard["documents"] or len(tokens) != shard["tokens"]:
    raise UserError(f"shard {path}: counts differ from the manifest ({len(index)} documents and {len(tokens)} "
                    f"tokens; it says {shard['documents']} and {shard['tokens']})")
  why = index_problem(directory / shard["files"]["index"]["name"], len(tokens), index)
  if why is None and (verify if ids is None else ids):
    why = ids_problem(path, tokens, index, vocab_size)
  if why is not None:
    raise UserError(why)
  return tokens, index


def file_problem(directory: Path, shard: dict, key: str, vocab_size: int) -> str | None:
  """Shard file `key` against its digest; after the tokens file, the shard's content too (its index and ids)."""
  why = problem(directory, shard["files"][key], True)
  if why is None and key == "tokens":
    try:
      checked(directory, shard, False, vocab_size, ids=True)
    except UserError as e:
      why = str(e)
  return why


_opened, _lock = {}, threading.Lock()  # verified datasets, by manifest and shard files' stat


def open_prepared(directory: Path, verify: bool = True) -> tuple[TokenSet, dict]:
  """Memory-maps a prepared dataset checked against its manifest (once while manifest and shard stats hold):
  sizes and index always; with `verify`, digests and token ids too (each process its share)."""
  manifest = read_manifest(directory)
  entries = [entry for shard in manifest["shards"] for entry in shard["files"].values()]
  stats = [(p.stat().st_mtime_ns, p.stat().st_size) if p.exists() else None
           for p in (directory / e["name"] for e in entries)]
  key = (str(directory.resolve()), (directory / MANIFEST).read_bytes(), verify, tuple(stats))
  with _lock:
    if key in _opened:
      return _opened[key], manifest
  vocab, listed = manifest["tokenizer"]["vocab_size"], manifest["shards"]
  if verify and filecheck.processes()[0] > 1:
    # Several processes: each hashes its share of the files (and checks the ids of its token files); all stop on
    # the same problem.
    which = [(shard, key) for shard in listed for key in shard["files"]]
    if (first := filecheck.first_problem([e["bytes"] for e in entries],
                                         lambda i: file_problem(directory, *which[i], vocab))) is not None:
      raise UserError(first)
    verify = False  # what is left below is the cheap size and index check
  arrays, parts, masks = [], [], []
  for n, shard in enumerate(listed):
    tokens, index = checked(directory, shard, verify, vocab)
    arrays.append(tokens)
    masks.append(mask_of(directory, shard, len(tokens)))
    parts.append(np.concatenate([np.full((len(index), 1), n, np.int64), index.astype(np.int64)], axis=1))
  index = np.concatenate(parts) if parts else np.zeros((0, 4), np.int64)
  if any(m is not None for m in masks) and any(m is None for m in masks):
    raise UserError(f"{directory / MANIFEST}: some shards have a mask file and some do not (re-run prepare)")
  ts = TokenSet(arrays, index, str(directory), masks if masks and masks[0] is not None else None,
                manifest.get("kind") == "preference")
  with _lock:
    _opened[key] = ts
  return ts, manifest
