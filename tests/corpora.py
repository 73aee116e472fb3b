"""Small corpora written and prepared inside tests (nothing downloaded)."""

import json
import random

from jaxtrain.data.prepare import prepare


def texts(n: int, seed: int = 0, alphabet: str = "abcdefghij klmnop", lo: int = 1, hi: int = 90) -> list[str]:
  """n distinct documents of varied length (some longer than a row); distinct by a numbered prefix."""
  r = random.Random(seed)
  return [f"{i}:" + "".join(r.choice(alphabet) for _ in range(r.randrange(lo, hi))) for i in range(n)]


def write_jsonl(path, records) -> str:
  path.write_text("".join(json.dumps(rec) + "\n" for rec in records))
  return str(path)


def prepared(tmp_path, name: str, docs: list[str], **kw) -> str:
  """Writes docs as JSON Lines and prepares them (byte tokenizer unless given); returns the dir."""
  src = write_jsonl(tmp_path / f"{name}.jsonl", [{"text": d} for d in docs])
  out = tmp_path / name
  prepare([src], kw.pop("tokenizer", "byte"), str(out), progress=False, **kw)
  return str(out)
