"""Deduplication for `data prepare --dedup`: a key per document (computed where the document is read, in the
workers) and one keep decision over the whole corpus in input order (in the parent), so the shards do not depend
on how many workers made them.

exact: the blake2b-128 digest of the normalized text. Normalization: Unicode NFKC, case-folded, every run of
whitespace one space, no leading or trailing whitespace (so "Hello  World\n" and "hello world" are one text).
near: MinHash (datasketch >= 2, NUM_PERM permutations, seed SEED, its affine32 scheme) of the normalized text's word SHINGLE-grams, with LSH
banding (datasketch.MinHashLSH) for candidates; a candidate is a duplicate when its estimated Jaccard similarity to
a kept document is at least the threshold. The first occurrence in input order is kept."""

from __future__ import annotations

import hashlib
import re
import unicodedata

import numpy as np

MODES = ("none", "exact", "near")
NUM_PERM, SEED, SHINGLE, SCHEME = 128, 1, 5, "affine32"  # the scheme named: a library default may change
NEAR_THRESHOLD = 0.8
NORMALIZATION = "Unicode NFKC, case-folded, whitespace runs as one space, stripped"
_SPACE, _WORD = re.compile(r"\s+"), re.compile(r"\w+")


def normalize(text: str) -> str:
  return _SPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def _shingles(text: str) -> set[bytes]:
  words = _WORD.findall(normalize(text))
  n = min(SHINGLE, len(words))  # a text shorter than a shingle is one shingle of all its words
  return {" ".join(words[i:i + n]).encode() for i in range(len(words) - n + 1)} if words else {b""}


def key(mode: str, text: str):
  """The document's key: bytes (exact) or a uint32[NUM_PERM] MinHash signature (near)."""
  if mode == "exact":
    return hashlib.blake2b(normalize(text).encode(), digest_size=16).digest()
  from datasketch import MinHash
  m = MinHash(num_perm=NUM_PERM, seed=SEED, scheme=SCHEME)
  m.update_batch(sorted(_shingles(text)))
  return m.hashvalues  # uint32: 512 bytes a document


class Deduper:
  """Sees keys in input order; `seen(key)` says whether an earlier kept document is a duplicate of this one, and
  keeps this one when not."""

  def __init__(self, mode: str, threshold: float = NEAR_THRESHOLD):
    self.mode, self.threshold = mode, threshold
    self.kept = set() if mode == "exact" else []  # exact: the digests; near: the kept signatures, by LSH key
    if mode == "near":
      from datasketch import MinHashLSH
      self.lsh = MinHashLSH(threshold=threshold, num_perm=NUM_PERM)

  def seen(self, k) -> bool:
    if self.mode == "exact":
      dup = k in self.kept
      self.kept.add(k)
      return dup
    from datasketch import LeanMinHash, MinHash
    m = LeanMinHash(MinHash(num_perm=NUM_PERM, seed=SEED, hashvalues=k, scheme=SCHEME))
    if any(float(np.mean(self.kept[i] == k)) >= self.threshold for i in self.lsh.query(m)):
      return True
    self.lsh.insert(len(self.kept), m, check_duplication=False)
    self.kept.append(k)
    return False
