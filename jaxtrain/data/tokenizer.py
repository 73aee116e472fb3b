"""Tokenizers: "byte" (built in) or a local tokenizer.json; a 16-hex digest names one in manifests and checkpoints."""

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
  spec, vocab_size = "byte", 256 + OFFSET
  digest = hashlib.sha256(b"jaxtrain-byte-tokenizer-v1").hexdigest()[:16]
  bos_id, eos_id, pad_id = BOS, EOS, PAD

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) + self.OFFSET for t in texts]

  def encode(self, text: str) -> np.ndarray:
    """One document as it is stored and trained on: BOS body EOS."""
    return frame(self, self.encode_batch([text])[0])

  def decode(self, ids) -> str:
    return bytes(int(i) - self.OFFSET for i in ids if int(i) >= self.OFFSET).decode("utf-8", errors="replace")


class HFTokenizer:
  """A local tokenizer.json (nothing fetched from a hub). EOS is required, BOS optional."""

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
    self.spec, self.digest = str(p.resolve()), sha256_file(p)[:16]
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.eos_id = self._special(eos_token, EOS_CANDIDATES, "EOS", "--eos-token", required=True)
    self.bos_id = self._special(bos_token, BOS_CANDIDATES, "BOS", "--bos-token", required=False)
    self.pad_id = self.eos_id  # padding is masked by segment id 0, its token id never matters

  def _special(self, given, candidates, what, flag, required):
    if given:
      if self._tok.token_to_id(given) is None:
        raise UserError(f"tokenizer {self.spec!r} has no token {given!r} ({flag})")
      return self._tok.token_to_id(given)
    found = [i for i in map(self._tok.token_to_id, candidates) if i is not None]
    if required and not found:
      raise UserError(f"tokenizer {self.spec!r} has none of the {what} tokens {', '.join(candidates)}; name one with {flag}")
    return found[0] if found else None

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(e.ids, np.int32) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

  def encode_offsets(self, texts: list[str]) -> list[tuple[np.ndarray, list[tuple[int, int]]]]:
    """Ids and each token's character span in its text (chat masks map template spans onto tokens)."""
    return [(np.asarray(e.ids, np.int32), e.offsets) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

  def token(self, i: int) -> str:
    return self._tok.id_to_token(int(i))

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def frame(tok, *bodies) -> np.ndarray:
  """[BOS] bodies... EOS (BOS where the tokenizer has one), as int32."""
  head = [] if tok.bos_id is None else [tok.bos_id]
  return np.concatenate([head, *bodies, [tok.eos_id]]).astype(np.int32)


def load(spec: str, bos_token: str | None = None, eos_token: str | None = None):
  return ByteTokenizer() if spec == "byte" else HFTokenizer(spec, bos_token, eos_token)


def digest_of(spec: str) -> str:
  """The digest of the tokenizer named by `spec`, without loading the library."""
  if spec == "byte":
    return ByteTokenizer.digest
  if not Path(spec).is_file():
    raise UserError(f"data.tokenizer={spec!r} does not exist; use 'byte' or a path to a tokenizer.json")
  return sha256_file(Path(spec))[:16]
