"""Raw .txt/.jsonl/.parquet read in work units (byte ranges cut at record boundaries, or Parquet row groups)."""

from __future__ import annotations

import json
import mmap
import re
from pathlib import Path

from jaxtrain.core.errors import UserError

FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
SEPARATOR = {"txt": b"\n\n", "jsonl": b"\n"}  # .txt documents are separated by a blank line
BOM = b"\xef\xbb\xbf"
# A .txt line ends in LF, CRLF or CR (as Python's universal newlines read it); a blank line is two line ends.
_LINE_END = rb"(?:\r\n|\r(?!\n)|\n)"  # a CR before an LF is one line end with it, never two
_BLANK_LINE = re.compile(_LINE_END * 2)


def _lf(blob: bytes) -> bytes:
  """.txt bytes with every line end (CRLF, CR) made LF, so documents and line numbers are those of the LF text."""
  return blob.replace(b"\r\n", b"\n").replace(b"\r", b"\n") if b"\r" in blob else blob


class BadRecord(Exception):
  """One unreadable record; str() names its file and line or row."""


def file_format(path: Path) -> str:
  if not path.is_file():
    raise UserError(f"input {str(path)!r} does not exist or is not a file")
  fmt = FORMATS.get(path.suffix)
  if fmt is None:
    raise UserError(f"input {str(path)!r}: unsupported file type {path.suffix!r}; use {', '.join(FORMATS)}")
  return fmt


def parquet_file(path: Path):
  """pyarrow's ParquetFile; a file that is not Parquet is a one-line user error."""
  try:
    import pyarrow
    import pyarrow.parquet as pq
  except ImportError:
    raise UserError("reading Parquet needs the 'pyarrow' package: pip install 'jaxtrain[data]'") from None
  try:
    return pq.ParquetFile(path)
  except (pyarrow.ArrowException, OSError) as e:
    why = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise UserError(f"input {str(path)!r} is not a readable Parquet file ({why})") from None


def plan_units(path: Path, unit_bytes: int) -> list[tuple[int, int]]:
  """Ranges [start, end) of about unit_bytes each: bytes at record boundaries, or row groups."""
  fmt = file_format(path)
  if fmt == "parquet":
    meta = parquet_file(path).metadata
    units, start, size = [], 0, 0
    for g in range(meta.num_row_groups):
      size += meta.row_group(g).total_byte_size
      if size >= unit_bytes:
        units.append((start, g + 1))
        start, size = g + 1, 0
    if start < meta.num_row_groups:
      units.append((start, meta.num_row_groups))
    return units
  total = path.stat().st_size
  if total == 0:
    return []
  sep, units, start = SEPARATOR[fmt], [], 0
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
    while start < total:
      at = min(start + unit_bytes, total)
      if fmt == "txt":  # never cuts a CRLF in two: the match takes the whole pair
        found = _BLANK_LINE.search(mm, max(at - 1, start))
        cut = total if found is None else found.end()
      else:
        cut = mm.find(sep, at)
        cut = total if cut < 0 else cut + len(sep)
      units.append((start, cut))
      start = units[-1][1]
  return units


def _record(obj, fields: dict, where, render=None):
  """The text, (prompt, completion), or rendered chat (`render(turns)`) of a record; `where()` names it, computed
  only for an error."""
  out = []
  for name in fields.values():
    if not isinstance(obj, dict) or name not in obj:
      raise BadRecord(f"{where()}: no {name!r} field")
    if "chat" in fields:
      if not isinstance(obj[name], list):
        raise BadRecord(f"{where()}: field {name!r} is {type(obj[name]).__name__}, not a list of turns")
      try:
        return render(obj[name])
      except Exception as e:  # noqa: BLE001 (chat.RenderError: the template refused this record)
        raise BadRecord(f"{where()}: {e}") from None
    if not isinstance(obj[name], str):
      raise BadRecord(f"{where()}: field {name!r} is {type(obj[name]).__name__}, not a string")
    out.append(obj[name])
  if "chosen" in fields and out[1].strip() and out[1].strip() == out[2].strip():  # (blank ones: empty documents)
    raise BadRecord(f"{where()}: fields {fields['chosen']!r} and {fields['rejected']!r} hold the same response: no "
                    "preference to learn (DPO would stay at loss ln 2 with no gradient)")
  return out[0] if "text" in fields else tuple(out)


def read_unit(path: Path, start: int, end: int, fields: dict, on_bad, render=None) -> list:
  """The records of one unit. `on_bad(BadRecord)` is called per bad record (it may raise); `render` makes a chat
  record's turns its (text, spans)."""
  fmt = file_format(path)
  if fmt == "parquet":
    return _read_parquet(path, start, end, fields, on_bad, render)
  with open(path, "rb") as f:
    f.seek(start)
    blob = f.read(end - start)
  if start == 0 and blob.startswith(BOM):  # an editor's UTF-8 byte-order mark: no part of the first record
    blob = blob[len(BOM):]
  if fmt == "txt":
    blob = _lf(blob)
  line0 = []

  def where(offset):  # file:line of byte `offset` of the unit; lines are counted only for errors
    if not line0:
      with open(path, "rb") as f:
        head = f.read(start)
        line0.append((_lf(head) if fmt == "txt" else head).count(b"\n") + 1)
    return f"{path}:" + str(line0[0] + blob.count(b"\n", 0, offset))

  out, pos, sep = [], 0, SEPARATOR[fmt]
  for piece in blob.split(sep):
    here, pos = pos, pos + len(piece) + len(sep)
    if not piece.strip():
      continue
    try:
      try:
        text = piece.decode("utf-8")
      except UnicodeDecodeError as e:
        raise BadRecord(f"{where(here + e.start)}: invalid UTF-8 (byte 0x{piece[e.start]:02x})") from None
      if fmt == "txt":
        if "text" not in fields:
          raise UserError(f"input {str(path)!r}: supervised (prompt/completion) and chat data must be .jsonl or "
                          ".parquet")
        out.append(text.strip())
        continue
      try:
        obj = json.loads(text)
      except json.JSONDecodeError as e:
        raise BadRecord(f"{where(here)}: invalid JSON ({e.msg})") from None
      out.append(_record(obj, fields, lambda: where(here), render))
    except BadRecord as bad:
      on_bad(bad)
  return out


def _read_parquet(path: Path, start: int, end: int, fields: dict, on_bad, render=None) -> list:
  pf = parquet_file(path)
  names = list(fields.values())
  if missing := [n for n in names if n not in pf.schema_arrow.names]:
    raise UserError(f"input {str(path)!r} has no column {missing[0]!r}; columns: {', '.join(pf.schema_arrow.names)}")
  first_row = sum(pf.metadata.row_group(g).num_rows for g in range(start))
  table = pf.read_row_groups(list(range(start, end)), columns=names)
  cols, out = {n: table.column(n).to_pylist() for n in names}, []
  for i in range(table.num_rows):
    where = lambda: f"{path} row {first_row + i + 1}"  # noqa: E731
    try:
      obj = {}
      for n in names:
        v = cols[n][i]
        if isinstance(v, bytes):
          try:
            v = v.decode("utf-8")
          except UnicodeDecodeError as e:
            raise BadRecord(f"{where()}: column {n!r} is invalid UTF-8 (byte 0x{v[e.start]:02x})") from None
        if v is not None:
          obj[n] = v
      out.append(_record(obj, fields, where, render))
    except BadRecord as bad:
      on_bad(bad)
  return out


def read_documents(source: str, text_field: str = "text") -> list[str]:
  """All texts of one .txt/.jsonl/.parquet file; any bad record is an error."""
  path = Path(source)
  if not path.is_file():
    raise UserError(f"data.source={source!r} is not a file; use 'bundled', a prepared directory, "
                    f"or a .txt, .jsonl or .parquet file")

  def fail(bad):
    raise UserError(f"{bad} (data.text_field={text_field!r})" if "field" in str(bad) else str(bad))
  docs = [d for a, b in plan_units(path, 1 << 62) for d in read_unit(path, a, b, {"text": text_field}, fail)
          if d.strip()]
  if not docs:
    raise UserError(f"data.source={source!r} holds no documents")
  return docs
