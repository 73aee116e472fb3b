"""`python -m jaxtrain.data prepare`: raw corpora -> token shards + manifest, one shard per work unit in
worker processes; a shard's .json, written last, marks it complete, so a re-run skips it (resume)."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import math
import multiprocessing
import os
import sys
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import tqdm

from jaxtrain.data import dedup as dedup_lib, readers, shards, tokenizer as tokenizer_lib
from jaxtrain.core.errors import UserError
from jaxtrain.core.files import errno_text, sha256_file, write_json_atomic

JOB, _worker_tok = "prepare.json", None
MAX_SHARD_MB = 65536.0  # a unit is read into one worker's memory whole
PARENT_POLL_S = 0.25


class _Writes:
  """A file numpy writes through Python's write(): a full disk is then OSError ENOSPC (numpy's own writes to a real
  file report a short write, without the errno)."""

  def __init__(self, f):
    self.write, self.name = f.write, f.name


def _save(directory: Path, name: str, array: np.ndarray) -> dict:
  tmp = directory / (name + ".tmp")
  try:
    with open(tmp, "wb") as f:
      np.save(_Writes(f), array)
    os.replace(tmp, directory / name)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
  return {"name": name, "bytes": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}


def _exit_with_parent(parent: int) -> None:
  """A worker ends when the parent that started it is gone (killed: it never shuts the pool down), so no
  worker, nor the resource tracker they keep alive, outlives it."""
  if sys.platform.startswith("linux"):
    try:  # immediate: the kernel signals this process when its parent dies
      import ctypes
      import signal
      ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
      pass

  def watch():  # portable, and covers a parent gone before the prctl above
    while os.getppid() == parent:
      time.sleep(PARENT_POLL_S)
    os._exit(1)
  threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _init_worker(spec, bos, eos, parent=None):
  global _worker_tok
  if parent is not None:
    _exit_with_parent(parent)
  os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already: no extra tokenizer threads
  _worker_tok = tokenizer_lib.load(spec, bos, eos)


def _read(job: dict, n: int, bad: list) -> list:
  """Unit n's records in input order; unreadable ones are appended to `bad` (up to --max-bad-records)."""
  unit, chat = job["units"][n], "chat" in job["fields"]

  def on_bad(err):
    bad.append(str(err))
    if len(bad) > job["max_bad_records"]:
      raise UserError(f"{err} (more than --max-bad-records={job['max_bad_records']} bad records)")
  return readers.read_unit(Path(job["sources"][unit[0]]["path"]), unit[1], unit[2], job["fields"], on_bad,
                           _renderer(job).render if chat else None)


def _parts(job: dict, record) -> tuple:
  """The texts of a record that the filters see: the text, prompt + completion, prompt + both responses, or the
  rendered chat."""
  return (record[0],) if "chat" in job["fields"] else (record,) if isinstance(record, str) else tuple(record)


def _blank(job: dict, record) -> bool:
  """A record dropped as an empty document (counted so, never by the filters): an all-whitespace text or
  prompt + completion, or a preference record with an all-whitespace response."""
  if "chat" in job["fields"]:
    return False
  parts = _parts(job, record)
  return not all(r.strip() for r in parts[1:]) if "chosen" in job["fields"] else not any(p.strip() for p in parts)


def _length(job: dict, record) -> str | None:
  """'too_short' / 'too_long' by --min-chars/--max-chars (characters of all the record's texts), else None."""
  f, chars = job.get("filters", {}), sum(len(p) for p in _parts(job, record))
  if f.get("min_chars") is not None and chars < f["min_chars"]:
    return "too_short"
  return "too_long" if f.get("max_chars") is not None and chars > f["max_chars"] else None


def unit_keys(job: dict, n: int) -> list:
  """Dedup pass: (record index, key) of each of unit n's records that the length filters keep."""
  mode, records = job["filters"]["dedup"], _read(job, n, [])
  return [(i, dedup_lib.key(mode, "\n".join(_parts(job, r)))) for i, r in enumerate(records)
          if not _blank(job, r) and _length(job, r) is None]


def run_unit(job: dict, n: int, output: str, tok=None, duplicates=()) -> dict:
  """Tokenizes unit n into shard n, less its records filtered by length and those indexed in `duplicates`;
  returns the shard's meta (also written to shard-n.json)."""
  tok, unit, out, bad, dropped = tok or _worker_tok, job["units"][n], Path(output), [], set(duplicates)
  counts = {"too_short": 0, "too_long": 0, "duplicates": len(dropped)}
  records = []
  for i, r in enumerate(_read(job, n, bad)):
    why = None if _blank(job, r) else _length(job, r)
    if why:
      counts[why] += 1
    elif i not in dropped:
      records.append(r)
  make = _chat_docs if "chat" in job["fields"] else _pair_docs if "chosen" in job["fields"] else _text_docs
  docs, train_from, mask, empty = make(tok, job, records)
  tokens, index = shards.concat(docs, train_from)
  lengths, names = index[:, 1], {"tokens": f"shard-{n:05d}.tokens.npy", "index": f"shard-{n:05d}.index.npy"}
  arrays = [tokens.astype(job["dtype"]), index]
  if mask is not None:  # chat: trained spans anywhere in a document, one flag per token
    names["mask"], arrays = f"shard-{n:05d}.mask.npy", [*arrays, mask]
  meta = {
      "unit": unit, "documents": len(docs), "tokens": int(lengths.sum()),
      "trainable_tokens": int((lengths - index[:, 2]).sum()) if mask is None else int(mask.sum()),
      "empty_documents": empty, **counts, "bad_records": bad, "input_bytes": unit[3],
      "files": {k: _save(out, v, a) for (k, v), a in zip(names.items(), arrays)},
  }
  write_json_atomic(out / f"shard-{n:05d}.json", meta)
  return meta


def _text_docs(tok, job, records):
  """Texts and prompt/completion pairs: [BOS] prompt completion EOS, trained from the completion on."""
  # A text is an empty prompt + a completion. Texts are kept byte for byte; all-whitespace ones are dropped.
  nonempty = [r if "prompt" in job["fields"] else ("", r) for r in records if not _blank(job, r)]
  prompts = tok.encode_batch([p for p, _ in nonempty])
  docs = [tokenizer_lib.frame(tok, p, c) for p, c in zip(prompts, tok.encode_batch([c for _, c in nonempty]))]
  train_from = [max(1, len(p) + (tok.bos_id is not None)) for p in prompts]  # BOS is never a target
  return docs, train_from, None, len(records) - len(nonempty)


def _pair_docs(tok, job, records):
  """Preference records -> two documents each, in the record's order (chosen at 2i, rejected at 2i + 1: the loader
  keeps them together): [BOS] prompt response EOS, trained from the response on. A record with an all-whitespace
  response is dropped whole, so pairs stay aligned."""
  kept = [rec for rec in records if not _blank(job, rec)]
  prompts = tok.encode_batch([p for p, _, _ in kept])
  chosen, rejected = tok.encode_batch([c for _, c, _ in kept]), tok.encode_batch([r for _, _, r in kept])
  docs, train_from = [], []
  for p, c, r in zip(prompts, chosen, rejected):
    docs += [tokenizer_lib.frame(tok, p, c), tokenizer_lib.frame(tok, p, r)]
    train_from += [max(1, len(p) + (tok.bos_id is not None))] * 2
  return docs, train_from, None, len(records) - len(kept)


_renderers = {}  # per process: the job's compiled chat template


def _renderer(job):
  from jaxtrain.data import chat
  spec = job["chat_template"]
  key = json.dumps(spec, sort_keys=True)
  if key not in _renderers:
    _renderers[key] = chat.Renderer(spec["text"], spec["where"], spec["context"], spec["specials"])
  return _renderers[key]


def _chat_docs(tok, job, records):
  """Rendered chats: the template's tokens as they are (its own BOS/EOS, no framing added), a per-token mask of
  the generation spans, and the first trained token in the index."""
  from jaxtrain.data import chat
  docs, masks = [], []
  for (ids, offsets), (_, spans) in zip(tok.encode_offsets([text for text, _ in records]), records):
    docs.append(ids)
    masks.append(chat.assistant_mask(offsets, spans))
  train_from = [int(np.argmax(m)) if m.any() else len(m) for m in masks]
  mask = np.concatenate(masks) if masks else np.zeros(0, np.uint8)
  return docs, train_from, mask, 0


def _finished(out: Path, n: int, unit: list) -> dict | None:
  """The meta of shard n if it is complete and intact (sizes and digests), else None."""
  path = out / f"shard-{n:05d}.json"
  if not path.is_file():
    return None
  try:
    meta = json.loads(path.read_text())
    intact = all(shards.problem(out, entry, verify=True) is None for entry in meta["files"].values())
    return meta if intact and meta["unit"] == unit else None
  except (ValueError, TypeError, KeyError, AttributeError, OSError):  # unreadable: made again
    return None


def plan(inputs: list[str], tok, fields: dict, shard_mb: float, max_bad: int, chat_template=None,
         filters=None) -> dict:
  sources, units = [], []
  for i, name in enumerate(inputs):
    path = Path(name)
    fmt = readers.file_format(path)
    try:
      size, digest = path.stat().st_size, sha256_file(path)
      ranges = readers.plan_units(path, max(1, int(shard_mb * 2**20)))
    except OSError as e:
      raise UserError(f"input {name!r} cannot be read ({errno_text(e.errno) if e.errno else e})") from None
    sources.append({"path": str(path.resolve()), "format": fmt, "bytes": size, "sha256": digest})
    span = ranges[-1][1] if ranges else 1
    for a, b in ranges:  # input bytes of a unit: exact for text, proportional to row groups for Parquet
      units.append([i, a, b, b - a if fmt != "parquet" else round(size * (b - a) / span)])
  if not units:
    raise UserError(f"the inputs ({', '.join(inputs)}) hold no data: an empty corpus")
  return {"sources": sources, "units": units, "fields": fields, "max_bad_records": max_bad,
          **({"chat_template": chat_template} if chat_template else {}),
          **({"filters": filters} if filters else {}),  # absent when off: a job from before filters resumes
          "tokenizer": {"spec": tok.spec, "digest": tok.digest, "vocab_size": tok.vocab_size,
                        "bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id},
          "dtype": "uint16" if tok.vocab_size <= 1 << 16 else "uint32"}


def _shown(value) -> str:
  return f"{value:g}" if isinstance(value, float) else str(value)


def _check_fields(fields: dict) -> None:
  """Each --KIND-field given names a field."""
  for kind, name in fields.items():
    if name is not None and not name.strip():
      raise UserError(f"--{kind}-field {name!r}: must name a field of the records (a JSON key or Parquet column)")


def _check_distinct(fields: dict) -> None:
  """No two fields of the data are one field (a prompt trained as its own completion, a response preferred
  to itself)."""
  seen = {}
  for kind, name in fields.items():
    if name in seen:
      raise UserError(f"--{seen[name]}-field and --{kind}-field both name {name!r}: each must name its own field")
    seen[name] = kind


def _check_options(inputs, workers, shard_mb, max_bad_records, prompt_field, completion_field, chat_field=None,
                   chat_template=None, pair_fields=(None, None), text_field="text") -> None:
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
    raise UserError(f"--workers {workers}: must be a positive integer")
  if not isinstance(shard_mb, (int, float)) or not math.isfinite(shard_mb) or not 0 < shard_mb <= MAX_SHARD_MB:
    raise UserError(f"--shard-mb {_shown(shard_mb)}: must be a number of megabytes above 0 and at most "
                    f"{MAX_SHARD_MB:g} (a shard's input is read into memory whole)")
  if isinstance(max_bad_records, bool) or not isinstance(max_bad_records, int) or max_bad_records < 0:
    raise UserError(f"--max-bad-records {max_bad_records}: must be 0 or a positive integer")
  if not inputs:
    raise UserError("prepare needs at least one --input")
  _check_fields({"text": text_field, "prompt": prompt_field, "completion": completion_field, "chat": chat_field,
                 "chosen": pair_fields[0], "rejected": pair_fields[1]})
  if any(f is not None for f in pair_fields):
    if None in pair_fields or prompt_field is None:
      raise UserError("preference data needs all of --prompt-field, --chosen-field and --rejected-field")
    if completion_field is not None or chat_field is not None:
      raise UserError(f"--{'completion' if completion_field else 'chat'}-field is another kind of data than "
                      "preference data (--chosen-field/--rejected-field): give one kind")
    return _check_chat_template(chat_template, chat_field)
  if (prompt_field is None) != (completion_field is None):
    raise UserError("supervised data needs both --prompt-field and --completion-field")
  if chat_field is not None and prompt_field is not None:
    raise UserError("--chat-field is chat data; --prompt-field/--completion-field are prompt/completion data: give "
                    "one kind")
  _check_chat_template(chat_template, chat_field)


def _filters(dedup: str, min_chars, max_chars, near_threshold) -> dict | None:
  """The job's filters (None when all are off), checked."""
  if dedup not in dedup_lib.MODES:
    raise UserError(f"--dedup {dedup!r}: must be one of {', '.join(dedup_lib.MODES)}")
  for flag, v in (("--min-chars", min_chars), ("--max-chars", max_chars)):
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
      raise UserError(f"--{flag[2:]} {v}: must be 0 or a positive integer (characters of a record's text)")
  if min_chars is not None and max_chars is not None and min_chars > max_chars:
    raise UserError(f"--min-chars {min_chars} is above --max-chars {max_chars}: no record could be kept")
  if near_threshold is not None:
    if dedup != "near":
      raise UserError(f"--near-threshold {_shown(near_threshold)} applies to --dedup near (not {dedup})")
    if not isinstance(near_threshold, (int, float)) or not 0 < near_threshold <= 1:
      raise UserError(f"--near-threshold {_shown(near_threshold)}: must be a Jaccard similarity above 0 and at "
                      "most 1")
  if dedup == "near":
    try:
      import datasketch  # noqa: F401
    except ImportError:
      raise UserError("--dedup near needs the 'datasketch' package: pip install 'jaxtrain[data]'") from None
  if dedup == "none" and min_chars is None and max_chars is None:
    return None
  near = {"near_threshold": float(near_threshold or dedup_lib.NEAR_THRESHOLD)} if dedup == "near" else {}
  return {"dedup": dedup, "min_chars": min_chars, "max_chars": max_chars, **near}


def _check_chat_template(chat_template, chat_field) -> None:
  if chat_template is not None and chat_field is None:
    raise UserError("--chat-template applies to chat data: give --chat-field too")


def _claim(out: Path, output: str, job: dict) -> bool:
  """Checks that `out` is empty or holds this same job; True when the job file must still be written."""
  if (out / JOB).is_file():
    try:
      same = json.loads((out / JOB).read_text()) == job
    except (OSError, ValueError) as e:
      raise UserError(f"{output!r} holds an unreadable {JOB} ({e}); choose another --output or empty it") from None
    if not same:
      raise UserError(f"{output!r} holds data prepared from other inputs or options; choose another --output or "
                      "empty it")
    return False
  if out.is_dir() and ((out / shards.MANIFEST).exists() or any(out.glob("shard-*"))):
    raise UserError(f"{output!r} holds shards or a {shards.MANIFEST} but no {JOB} (not this job's); choose another "
                    "--output or empty it")
  return True


def prepare(inputs: list[str], tokenizer: str, output: str, *, text_field: str = "text",
            prompt_field: str | None = None, completion_field: str | None = None, workers: int = 1,
            shard_mb: float = 64.0, max_bad_records: int = 0, bos_token: str | None = None,
            eos_token: str | None = None, progress: bool = True, chat_field: str | None = None,
            chat_template: str | None = None, chosen_field: str | None = None,
            rejected_field: str | None = None, dedup: str = "none", min_chars: int | None = None,
            max_chars: int | None = None, near_threshold: float | None = None) -> dict:
  """Prepares `inputs` into `output`; returns the manifest (also written to output/manifest.json)."""
  _check_options(inputs, workers, shard_mb, max_bad_records, prompt_field, completion_field, chat_field,
                 chat_template, (chosen_field, rejected_field), text_field)
  filters = _filters(dedup, min_chars, max_chars, near_threshold)
  fields = ({"chat": chat_field} if chat_field else
            {"prompt": prompt_field, "chosen": chosen_field, "rejected": rejected_field} if chosen_field else
            {"prompt": prompt_field, "completion": completion_field} if prompt_field else {"text": text_field})
  _check_distinct(fields)
  tok = tokenizer_lib.load(tokenizer, bos_token, eos_token)
  job = plan(inputs, tok, fields, shard_mb, max_bad_records, _chat_spec(tokenizer, tok, chat_template, chat_field),
             filters)
  out = Path(output)
  if out.exists() and not out.is_dir():
    raise UserError(f"--output {output}: is a file, not a directory; give a directory (created if missing)")
  new_job, created = _claim(out, output, job), not out.exists()
  try:
    out.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise UserError(f"--output {output}: cannot create that directory ({e.strerror})") from None
  # A manifest from before stays until the new one replaces it: the same job makes the same shards.
  had_manifest = (out / shards.MANIFEST).is_file()
  try:
    if new_job:
      write_json_atomic(out / JOB, job)
    return _run(job, out, tok, workers, (tokenizer, bos_token, eos_token), progress)
  except (OSError, BrokenProcessPool) as e:
    why = (errno_text(e.errno) if getattr(e, "errno", None) else str(e) or type(e).__name__) + (
        f" ({Path(e.filename).name})" if getattr(e, "filename", None) else "")
    raise UserError(f"prepare into {out} stopped: {why}; "
                    f"{_kept(out, job, had_manifest, new_job, created)}") from None


def _chat_spec(tokenizer: str, tok, template_file: str | None, chat_field: str | None) -> dict | None:
  """The template text, where it was found and the special tokens it sees; compiled once here to fail early."""
  if chat_field is None:
    return None
  from jaxtrain.data import chat
  text, where = chat.find_template(tokenizer, template_file)
  spec = {"where": where, "text": text, "context": chat.context(tok), "specials": sorted(tok.special_texts())}
  _renderer({"chat_template": spec})
  return spec


def _kept(out: Path, job: dict, had_manifest: bool, new_job: bool, created: bool) -> str:
  """After a failed write: removes what is of no use (temporaries, files of unfinished shards, and where no
  shard is finished, the job this run wrote); says what is kept."""
  kept_manifest = had_manifest and (out / shards.MANIFEST).is_file()
  finished = {n for n in range(len(job["units"])) if (out / f"shard-{n:05d}.json").is_file()}
  for path in out.glob("*"):
    shard = path.name[6:11] if path.name.startswith("shard-") else ""
    if path.name.endswith(".tmp") or (not kept_manifest and shard.isdigit() and int(shard) not in finished):
      path.unlink(missing_ok=True)
  if kept_manifest:
    return f"the dataset that was there is untouched ({out / shards.MANIFEST})"
  if finished:
    return (f"kept {len(finished)} finished shard(s) of {len(job['units'])} in {out}; free space and re-run the "
            "same command to resume")
  if new_job:
    (out / JOB).unlink(missing_ok=True)
  if created:
    try:
      out.rmdir()
    except OSError:
      pass
  return "nothing was kept"


def _bar(total: int, desc: str, unit: str, progress: bool):
  return tqdm.tqdm(total=total, desc=desc, disable=not progress or not sys.stderr.isatty(), file=sys.stderr,
                   bar_format="{desc} [{bar:30}] {n}/{total} " + unit + "  {postfix}  [{elapsed}<{remaining}]")


def _each(pool, fn, calls: list, on_result) -> None:
  """fn(*args) for each (n, args) of `calls`, in this process when `pool` is None, else in the pool;
  on_result(n, result) as each finishes."""
  if pool is None:
    for n, args in calls:
      on_result(n, fn(*args))
    return
  futures = {pool.submit(fn, *args): n for n, args in calls}
  try:
    for fut in cf.as_completed(futures):
      on_result(futures[fut], fut.result())
  except BaseException:
    pool.shutdown(cancel_futures=True)
    raise


def _duplicates(job: dict, upto: int, pool, progress: bool) -> dict[int, list[int]]:
  """The dedup pass over units [0, upto): keys in the workers, then one keep decision in input order (the first
  occurrence is kept); per unit, the indexes of its records that are duplicates."""
  keys, bar = {}, _bar(upto, "dedup", "units", progress)

  def got(n, unit_keys_):
    keys[n] = unit_keys_
    bar.update(1)
  _each(pool, unit_keys, [(n, (job, n)) for n in range(upto)], got)
  bar.close()
  seen = dedup_lib.Deduper(job["filters"]["dedup"], job["filters"].get("near_threshold", 1.0))
  return {n: [i for i, k in keys[n] if seen.seen(k)] for n in range(upto)}


def _run(job: dict, out: Path, tok, workers: int, tok_args: tuple, progress: bool) -> dict:
  """Tokenizes the shards not yet finished; writes and returns the manifest."""
  # Progress in shards, with input megabytes and what the filters dropped beside; finished shards of an earlier
  # run count at once.
  units, metas, todo, done_mb = job["units"], {}, [], [0.0, sum(u[3] for u in job["units"]) / 2**20]
  dropped = dict.fromkeys(DROPPED, 0)
  bar = _bar(len(units), "prepare", "shards", progress)

  def done(n, meta):
    metas[n] = meta
    done_mb[0] += units[n][3] / 2**20
    for k in dropped:
      dropped[k] += meta.get(k, 0)
    bar.set_postfix_str(f"{done_mb[0]:.1f}/{done_mb[1]:.1f} MB" + "".join(
        f", {v} {k.replace('_', ' ')}" for k, v in dropped.items() if k in _active(job)), refresh=False)
    bar.update(1)
  for n, unit in enumerate(units):
    if (meta := _finished(out, n, unit)) is None:
      todo.append(n)
    else:
      done(n, meta)
  # A unit's duplicates depend on every earlier unit: a resumed run keys units up to its last unfinished one.
  upto = max(todo) + 1 if todo and job.get("filters", {}).get("dedup", "none") != "none" else 0
  t0, calls = time.perf_counter(), max(len(todo), upto)
  procs = min(workers, calls) if workers > 1 and calls > 1 else 0
  pool = None
  if procs:
    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold JAX or tokenizer threads
    pool = cf.ProcessPoolExecutor(procs, mp_context=ctx, initializer=_init_worker, initargs=(*tok_args, os.getpid()))
  with pool or contextlib.nullcontext():
    dupes = _duplicates(job, upto, pool, progress) if upto else {}
    _each(pool, run_unit, [(n, (job, n, str(out), None if pool else tok, dupes.get(n, ()))) for n in todo], done)
  bar.close()
  seconds = time.perf_counter() - t0
  manifest = _manifest(job, metas, out)
  fresh = sum(units[n][3] for n in todo)
  ran = (f"{procs} worker processes" if procs else "1 worker, in this process" if todo else "nothing left to do")
  print(f"throughput: {fresh / 2**20:.2f} MB of input tokenized in {seconds:.2f}s = "
        f"{fresh / 2**20 / max(seconds, 1e-9):.1f} MB/s ({len(todo)} shard(s) this run, {ran})")
  return manifest


DROPPED = ("too_short", "too_long", "duplicates")  # what the filters drop, counted per shard and in the manifest


def _active(job: dict) -> tuple:
  """The counts of DROPPED that this job's filters can make."""
  f = job.get("filters") or {}
  return tuple(k for k, on in zip(DROPPED, (f.get("min_chars") is not None, f.get("max_chars") is not None,
                                             f.get("dedup", "none") != "none")) if on)


def _kind(fields: dict) -> str:
  return ("chat" if "chat" in fields else "preference" if "chosen" in fields else "supervised" if "prompt" in fields
          else "text")


def _described(job: dict) -> dict:
  """The filters as the manifest records them: the options and, for dedup, the method."""
  f = job.get("filters") or {"dedup": "none", "min_chars": None, "max_chars": None}
  how = {"exact": {"key": "blake2b-128 of the normalized text", "normalization": dedup_lib.NORMALIZATION},
         "near": {"key": f"MinHash of word {dedup_lib.SHINGLE}-grams of the normalized text, LSH candidates",
                  "normalization": dedup_lib.NORMALIZATION, "num_perm": dedup_lib.NUM_PERM,
                  "seed": dedup_lib.SEED}}.get(f["dedup"], {})
  return {**f, **how, **({"kept": "first occurrence in input order"} if how else {})}


def _manifest(job: dict, metas: dict[int, dict], out: Path) -> dict:
  ordered = [metas[n] for n in range(len(job["units"]))]
  bad = [b for m in ordered for b in m["bad_records"]]
  if len(bad) > job["max_bad_records"]:
    raise UserError(f"{bad[job['max_bad_records']]} (more than --max-bad-records={job['max_bad_records']} bad records)")
  kept = [m for m in ordered if m["documents"]]
  if not kept:
    dropped = {k: sum(m.get(k, 0) for m in ordered) for k in _active(job)}
    why = f" ({', '.join(f'{v} {k}' for k, v in dropped.items())} dropped by the filters)" if any(
        dropped.values()) else ""
    raise UserError(f"the inputs ({', '.join(s['path'] for s in job['sources'])}) hold no documents{why}: an empty "
                    "corpus")
  manifest = {
      "format": shards.FORMAT, "tokenizer": job["tokenizer"], "dtype": job["dtype"],
      "kind": _kind(job["fields"]),
      **({"chat_template": job["chat_template"]["where"]} if "chat_template" in job else {}),
      "fields": job["fields"], "sources": job["sources"],
      **{k: sum(m[k] for m in kept) for k in ("documents", "tokens", "trainable_tokens")},
      "filters": _described(job),
      "skipped": {"bad_records": len(bad), "empty_documents": sum(m["empty_documents"] for m in ordered),
                  **{k: sum(m.get(k, 0) for m in ordered) for k in DROPPED}, "examples": bad[:20]},
      "shards": [{k: m[k] for k in ("documents", "tokens", "trainable_tokens", "files")} for m in kept],
  }
  write_json_atomic(out / shards.MANIFEST, manifest)
  empty = manifest["skipped"]["empty_documents"]
  note = (f"prepared {manifest['documents']:,} documents, {manifest['tokens']:,} tokens in "
          f"{len(kept)} shard(s) -> {out / shards.MANIFEST}")
  if bad or empty:
    note += f"; skipped {len(bad)} bad record(s) and {empty} empty document(s)" + (f", first: {bad[0]}" if bad else "")
  if _active(job):
    note += "; filtered out " + ", ".join(f"{manifest['skipped'][k]:,} {k.replace('_', ' ')}" for k in _active(job))
  print(note)
  return manifest
