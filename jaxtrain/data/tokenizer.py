"""Tokenizers: "byte" (built in), a local tokenizer.json, or a folder as Hugging Face saves one (its tokenizer.json,
with the special tokens its tokenizer_config.json names); a 16-hex digest names one in manifests and checkpoints."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from jaxtrain.core.errors import UserError
from jaxtrain.core.files import sha256_file

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]")
TOKENIZER_FILE, CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def json_file(spec: str, label: str | None = None) -> Path:
  """The tokenizer.json that `spec` names: the file itself, or the one inside a folder (as save_pretrained writes
  it). `label` names the option in the error."""
  p, label = Path(spec), label or f"tokenizer {spec!r}"
  if p.is_dir():
    if not (p / TOKENIZER_FILE).is_file():
      raise UserError(f"{label} is a folder without a {TOKENIZER_FILE} (only Hugging Face fast tokenizers are read: "
                      "save one with transformers' save_pretrained)")
    return p / TOKENIZER_FILE
  if not p.is_file():
    raise UserError(f"{label} does not exist; use 'byte', a path to a tokenizer.json or a folder holding one")
  return p


def configured(folder: Path) -> dict[str, str | None] | None:
  """The special tokens tokenizer_config.json in `folder` names, as transformers reads them (a string or an
  AddedToken's content; null for none); None without a readable file."""
  try:
    raw = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8-sig"))
  except (OSError, ValueError):
    return None
  if not isinstance(raw, dict):
    return None
  out = {k: v.get("content") if isinstance(v, dict) else v for k, v in raw.items() if k in SPECIAL_KEYS}
  return {k: v for k, v in out.items() if v is None or isinstance(v, str)}


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
  """A local tokenizer.json (nothing fetched from a hub), alone or in its folder. EOS is required, BOS optional:
  each the flag's, else the one tokenizer_config.json beside it names, else (EOS; BOS without that file) a common
  one."""

  def __init__(self, path: str, bos_token: str | None = None, eos_token: str | None = None):
    try:
      import tokenizers
    except ImportError:
      raise UserError("a tokenizer.json needs the 'tokenizers' package: pip install 'jaxtrain[data]'") from None
    p = json_file(path)
    try:  # read as text: a UTF-8 byte-order mark is no part of the JSON
      self._tok = tokenizers.Tokenizer.from_str(p.read_text(encoding="utf-8-sig"))
    except Exception as e:  # the library raises plain Exceptions for malformed files
      raise UserError(f"tokenizer {path!r} cannot be read as a Hugging Face tokenizer.json: "
                      f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    self.spec, self.digest, self.folder = str(p.resolve()), sha256_file(p)[:16], p.parent
    self.named = configured(p.parent)
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.eos_id = self._special("eos_token", eos_token, EOS_CANDIDATES, "--eos-token", required=True)
    self.bos_id = self._special("bos_token", bos_token, BOS_CANDIDATES, "--bos-token", required=False)
    pad = self._tok.token_to_id((self.named or {}).get("pad_token") or "")
    self.pad_id = self.eos_id if pad is None else pad  # padding is masked by segment id 0: its id never matters

  def _special(self, key, given, candidates, flag, required):
    for value, source in ((given, flag), ((self.named or {}).get(key), f"{key} of {self.folder / CONFIG_FILE}")):
      if value:
        if self._tok.token_to_id(value) is None:
          raise UserError(f"tokenizer {self.spec!r} has no token {value!r} ({source})")
        return self._tok.token_to_id(value)
    if not required and self.named is not None:  # as transformers: a BOS tokenizer_config.json leaves out is none
      return None
    found = [i for i in map(self._tok.token_to_id, candidates) if i is not None]
    if required and not found:
      raise UserError(f"tokenizer {self.spec!r} has none of the {key[:3].upper()} tokens {', '.join(candidates)} and "
                      f"{CONFIG_FILE} beside it names none; name one with {flag}")
    return found[0] if found else None

  def special_texts(self) -> set[str]:
    """The texts of the special tokens: those the tokenizer.json marks special and those tokenizer_config.json names."""
    marked = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
    return marked | {v for v in (self.named or {}).values() if v}

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
  return sha256_file(json_file(spec, f"data.tokenizer={spec!r}"))[:16]
