"""Tokenizers: the built-in byte tokenizer, or a local Hugging Face `tokenizer.json`.

A tokenizer is named by a spec: "byte", or a path to a tokenizer.json (loaded through the
`tokenizers` package; nothing is fetched from a hub). Its digest identifies it in data
manifests and checkpoints: a constant for "byte", the sha256 of the file otherwise.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from jaxtrain.core.errors import UserError
from jaxtrain.core.files import sha256_file

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]")


class ByteTokenizer:
  """UTF-8 bytes shifted past three specials: PAD=0, BOS=1, EOS=2."""

  PAD, BOS, EOS, OFFSET = 0, 1, 2, 3
  vocab_size = 256 + OFFSET
  digest = hashlib.sha256(b"jaxtrain-byte-tokenizer-v1").hexdigest()[:16]
  spec = "byte"
  bos_id, eos_id, pad_id = BOS, EOS, PAD

  def encode_body(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + self.OFFSET

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    return [self.encode_body(t) for t in texts]

  def encode(self, text: str) -> np.ndarray:
    """BOS + body + EOS, one document as it is stored and trained on."""
    return frame(self, self.encode_body(text))

  def decode(self, ids) -> str:
    data = bytes(int(i) - self.OFFSET for i in ids if int(i) >= self.OFFSET)
    return data.decode("utf-8", errors="replace")


class HFTokenizer:
  """A local tokenizer.json. Specials: EOS is required (after every document), BOS optional."""

  def __init__(self, path: str, bos_token: str | None = None, eos_token: str | None = None):
    try:
      import tokenizers
    except ImportError:
      raise UserError("a tokenizer.json needs the 'tokenizers' package: pip install 'jaxtrain[data]'") from None
    p = Path(path)
    if not p.is_file():
      raise UserError(f"tokenizer {path!r} does not exist; use 'byte' or a path to a tokenizer.json")
    try:
      self._tok = tokenizers.Tokenizer.from_file(str(p))
    except Exception as e:  # the library raises plain Exceptions for malformed files
      raise UserError(f"tokenizer {path!r} cannot be read as a Hugging Face tokenizer.json: "
                      f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    self.spec = str(p.resolve())
    self.digest = sha256_file(p)[:16]
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.eos_id = self._special(eos_token, EOS_CANDIDATES, "EOS", "--eos-token", required=True)
    self.bos_id = self._special(bos_token, BOS_CANDIDATES, "BOS", "--bos-token", required=False)
    self.pad_id = self.eos_id  # padding is masked by segment id 0, its token id never matters

  def _special(self, given, candidates, what, flag, required):
    if given:
      i = self._tok.token_to_id(given)
      if i is None:
        raise UserError(f"tokenizer {self.spec!r} has no token {given!r} ({flag})")
      return i
    for c in candidates:
      i = self._tok.token_to_id(c)
      if i is not None:
        return i
    if required:
      raise UserError(f"tokenizer {self.spec!r} has none of the {what} tokens {', '.join(candidates)}; name one with {flag}")
    return None

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(e.ids, np.int32) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

  def encode(self, text: str) -> np.ndarray:
    return frame(self, self.encode_batch([text])[0])

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def frame(tok, *bodies) -> np.ndarray:
  """One document as it is stored and trained on: [BOS] bodies... EOS (BOS where the tokenizer has one)."""
  head = [] if tok.bos_id is None else [tok.bos_id]
  return np.concatenate([head, *bodies, [tok.eos_id]]).astype(np.int32)


def load(spec: str, bos_token: str | None = None, eos_token: str | None = None):
  """The tokenizer named by `spec` ("byte" or a tokenizer.json path)."""
  if spec == "byte":
    return ByteTokenizer()
  return HFTokenizer(spec, bos_token, eos_token)


def digest_of(spec: str) -> str:
  """The digest of the tokenizer named by `spec`, without loading the library."""
  if spec == "byte":
    return ByteTokenizer.digest
  p = Path(spec)
  if not p.is_file():
    raise UserError(f"data.tokenizer={spec!r} does not exist; use 'byte' or a path to a tokenizer.json")
  return sha256_file(p)[:16]
