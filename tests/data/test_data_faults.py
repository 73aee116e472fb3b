"""Issue 38, data pipeline: no mistake destroys data, none is a traceback, none is silently accepted.
One parametrized test per class: bad flags and manifests as one line; prepared shards whose digests match but
whose content is wrong; CRLF/CR text against the same text with LF; the workers `prepare` reports; helpers of a
killed `prepare`; a full disk during `prepare`."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxtrain.core import files
from jaxtrain.data import __main__ as data_command
from jaxtrain.data import readers
from jaxtrain.data import prepare as prepare_lib
from tests.corpora import prepared, texts, write_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _one_line(argv, capsys):
  """(exit code, the one stderr line) of `python -m jaxtrain.data ARGV`, run in-process."""
  with pytest.raises(SystemExit) as e:
    data_command.main(argv)
  err = capsys.readouterr().err
  lines = err.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
  return e.value.code, lines[0]


def _bench(directory):
  return ["bench", str(directory), "--batches", "1", "--set", "train.seq_len=16", "--set", "train.batch_size=4"]


# --- tracebacks -> one line ---------------------------------------------------------------------------------------

def _manifest_edit(edit):
  def apply(directory):
    path = directory / "manifest.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
  return apply


def _set(keys, value):
  def edit(m):
    obj = m
    for k in keys[:-1]:
      obj = obj[k]
    if value is KeyError:
      del obj[keys[-1]]
    else:
      obj[keys[-1]] = value
    return m
  return edit


PREPARE_FLAGS = {  # case: (extra flags, words of the one line)
    "shard-mb-nan": (["--shard-mb", "nan"], ["--shard-mb nan"]),
    "shard-mb-inf": (["--shard-mb", "inf"], ["--shard-mb inf"]),
    "shard-mb-minus-inf": (["--shard-mb=-inf"], ["--shard-mb -inf"]),
    "shard-mb-zero": (["--shard-mb", "0"], ["--shard-mb 0"]),
    "shard-mb-negative": (["--shard-mb", "-3"], ["--shard-mb -3"]),
    "shard-mb-huge": (["--shard-mb", "1e308"], ["--shard-mb 1e+308", "at most"]),
    "shard-mb-past-float": (["--shard-mb", "1e400"], ["--shard-mb inf"]),
    "max-bad-records-negative": (["--max-bad-records", "-1"], ["--max-bad-records -1"]),
}
PREPARE_DIRS = {  # case: (what the --output directory holds, words of the one line)
    "job-file-garbage": ({"prepare.json": "{not json"}, ["prepare.json", "unreadable"]),
    "job-file-binary": ({"prepare.json": b"\xff\xfe"}, ["prepare.json", "unreadable"]),
    "dataset-without-job": ({"manifest.json": "{}", "shard-00000.tokens.npy": "x"}, ["no prepare.json"]),
    "shards-without-job": ({"shard-00000.json": "{}"}, ["no prepare.json"]),
}
MANIFESTS = {  # case: (edit of a good manifest.json, words of the one line)
    "json-list": (lambda d: (d / "manifest.json").write_text("[1, 2]"), ["manifest.json", "a JSON list"]),
    "json-number": (lambda d: (d / "manifest.json").write_text("3"), ["manifest.json", "a JSON number"]),
    "json-string": (lambda d: (d / "manifest.json").write_text('"x"'), ["manifest.json", "a JSON string"]),
    "json-null": (lambda d: (d / "manifest.json").write_text("null"), ["manifest.json", "a JSON null"]),
    "no-shards": (_manifest_edit(_set(["shards"], KeyError)), ["manifest.json", "no 'shards'"]),
    "shards-a-dict": (_manifest_edit(_set(["shards"], {})), ["manifest.json", "shards is a JSON object"]),
    "no-tokenizer": (_manifest_edit(_set(["tokenizer"], KeyError)), ["no 'tokenizer'"]),
    "vocab-a-string": (_manifest_edit(_set(["tokenizer", "vocab_size"], "259")), ["vocab_size is '259'"]),
    "shard-not-a-dict": (_manifest_edit(_set(["shards", 0], 7)), ["shards[0] is 7, not an object"]),
    "shard-no-files": (_manifest_edit(_set(["shards", 0, "files"], KeyError)), ["shards[0]: no 'files'"]),
    "bytes-a-string": (_manifest_edit(_set(["shards", 0, "files", "tokens", "bytes"], "12")),
                       ["shards[0].files.tokens.bytes is '12'"]),
    "documents-a-bool": (_manifest_edit(_set(["shards", 0, "documents"], True)), ["shards[0].documents is True"]),
    "name-outside": (_manifest_edit(_set(["shards", 0, "files", "index", "name"], "../x.npy")),
                     ["shards[0].files.index.name is '../x.npy'"]),
    "no-digest": (_manifest_edit(_set(["shards", 0, "files", "tokens", "sha256"], KeyError)),
                  ["shards[0].files.tokens: no 'sha256'"]),
}


@pytest.mark.parametrize("case", [*PREPARE_FLAGS, *PREPARE_DIRS, *MANIFESTS])
def test_bad_flags_and_manifests_are_one_line(case, tmp_path, capsys):
  src = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts(30)])
  if case in PREPARE_DIRS:  # refused, and what was there is left as it was
    held, words = PREPARE_DIRS[case]
    (tmp_path / "o").mkdir()
    for name, blob in held.items():
      (tmp_path / "o" / name).write_bytes(blob if isinstance(blob, bytes) else blob.encode())
    code, line = _one_line(["prepare", "--input", src, "--output", str(tmp_path / "o"), "--workers", "1"], capsys)
    assert {p.name: p.read_bytes() for p in (tmp_path / "o").iterdir()} == \
        {k: v if isinstance(v, bytes) else v.encode() for k, v in held.items()}
  elif case in PREPARE_FLAGS:
    flags, words = PREPARE_FLAGS[case]
    code, line = _one_line(["prepare", "--input", src, "--output", str(tmp_path / "o"), "--workers", "1", *flags],
                           capsys)
    assert not (tmp_path / "o").exists()  # refused before anything was written
  else:
    edit, words = MANIFESTS[case]
    out = prepared(tmp_path, "d", texts(40), shard_mb=0.001)
    edit(tmp_path / "d")
    code, line = _one_line(_bench(out), capsys)
  assert code == 2
  for word in words:
    assert word in line, line


# --- content the digests cannot catch -----------------------------------------------------------------------------

def _shard(directory, n=0):
  m = json.loads((directory / "manifest.json").read_text())
  files_ = m["shards"][n]["files"]
  return (m, np.load(directory / files_["tokens"]["name"]), np.load(directory / files_["index"]["name"]))


def _rewrite(directory, n, manifest, tokens=None, index=None):
  """Writes shard n's arrays and the manifest with their sizes and digests, so only content checks can object."""
  for key, array in (("tokens", tokens), ("index", index)):
    if array is not None:
      entry = manifest["shards"][n]["files"][key]
      np.save(directory / entry["name"], array)
      entry["bytes"] = (directory / entry["name"]).stat().st_size
      entry["sha256"] = files.sha256_file(directory / entry["name"])
  (directory / "manifest.json").write_text(json.dumps(manifest))


def _index_edit(fn):
  def apply(d):
    m, tokens, index = _shard(d, 1)
    fn(index, len(tokens))
    _rewrite(d, 1, m, index=index)
  return apply


def _tokens_edit(fn):
  def apply(d):
    m, tokens, index = _shard(d, 1)
    tokens = fn(tokens)
    m["shards"][1]["tokens"] = len(tokens)
    m["tokens"] = sum(s["tokens"] for s in m["shards"])
    _rewrite(d, 1, m, tokens=tokens)
  return apply


def _set_at(offset, value, dtype=None):
  def fn(tokens):
    tokens = tokens.astype(dtype or tokens.dtype)
    tokens[offset] = value
    return tokens
  return fn


def _row(i, col, delta):
  def fn(index, n):
    index[i, col] += delta
  return fn


def _swap(index, n):
  index[[1, 2]] = index[[2, 1]]


def _manifest_only(fn):
  def apply(d):
    m = json.loads((d / "manifest.json").read_text())
    fn(m)
    (d / "manifest.json").write_text(json.dumps(m))
  return apply


def _drop_shard(m):
  del m["shards"][1]


def _twice(m):
  m["shards"].append(m["shards"][0])
  m["documents"] += m["shards"][0]["documents"]
  m["tokens"] += m["shards"][0]["tokens"]


def _garbage(d):
  m, _, _ = _shard(d, 1)
  entry = m["shards"][1]["files"]["tokens"]
  (d / entry["name"]).write_bytes(b"not an npy file" * 4)
  entry["bytes"], entry["sha256"] = 60, files.sha256_file(d / entry["name"])
  (d / "manifest.json").write_text(json.dumps(m))


def _empty_tokens(d):
  _tokens_edit(lambda t: t[:0])(d)


def _last(fn):  # an edit of the last index row, whatever the shard's row count
  def apply(index, n):
    fn(index, len(index) - 1)
  return apply


CORRUPT = {  # case: (edit, words of the one line)
    "row-past-end": (_index_edit(_last(lambda ix, i: ix.__setitem__((i, 1), ix[i, 1] + 5))),
                     ["shard-00001.index.npy", "row", "past the end"]),
    "row-start-past-end": (_index_edit(lambda ix, n: ix.__setitem__((2, 0), n + 10)),
                           ["shard-00001.index.npy", "row 2 (start", "past the end"]),
    "id-at-vocab": (_tokens_edit(_set_at(7, 259)), ["shard-00001.tokens.npy", "token id 259", "offset 7", "index row"]),
    "id-above-model-vocab": (_tokens_edit(_set_at(20, 600)), ["shard-00001.tokens.npy", "token id 600", "offset 20"]),
    "id-dtype-max": (_tokens_edit(_set_at(-1, 65535)), ["shard-00001.tokens.npy", "token id 65535"]),
    "id-negative": (_tokens_edit(_set_at(3, -5, np.int32)), ["shard-00001.tokens.npy", "token id -5", "offset 3"]),
    "rows-out-of-order": (_index_edit(_swap), ["shard-00001.index.npy", "row 1", "in order"]),
    "rows-overlap": (_index_edit(_row(2, 0, -1)), ["shard-00001.index.npy", "row 2", "overlap"]),
    "negative-length": (_index_edit(_row(0, 1, -1000)), ["shard-00001.index.npy", "row 0", "negative"]),
    "trainable-past-length": (_index_edit(_row(1, 2, 10_000)), ["shard-00001.index.npy", "row 1", "trainable"]),
    "rows-miss-tokens": (_index_edit(_last(lambda ix, i: ix.__setitem__((i, 1), ix[i, 1] - 1))),
                         ["shard-00001.index.npy", "cover"]),
    "index-two-columns": (lambda d: _rewrite(d, 1, _shard(d, 1)[0], index=_shard(d, 1)[2][:, :2]),
                          ["shard-00001.index.npy", "shape"]),
    "index-floats": (lambda d: _rewrite(d, 1, _shard(d, 1)[0], index=_shard(d, 1)[2].astype(np.float64)),
                     ["shard-00001.index.npy", "float64"]),
    "tokens-not-npy": (_garbage, ["shard-00001.tokens.npy", "not a readable .npy"]),
    "empty-shard": (_empty_tokens, ["shard-00001.index.npy", "past the end of the shard's 0 tokens"]),
    "shard-left-out": (_manifest_only(_drop_shard), ["manifest.json", "documents", "its shards hold"]),
    "shard-twice": (_manifest_only(_twice), ["manifest.json", "shard-00000.tokens.npy", "listed twice"]),
}


@pytest.mark.parametrize("case", CORRUPT)
def test_shards_whose_digests_match_but_content_is_wrong_are_refused(case, tmp_path, capsys):
  out = prepared(tmp_path, "d", texts(60), shard_mb=0.001)
  assert len(json.loads((tmp_path / "d" / "manifest.json").read_text())["shards"]) > 3
  assert data_command.main(_bench(out)) == 0  # the good dataset trains
  capsys.readouterr()
  edit, words = CORRUPT[case]
  edit(tmp_path / "d")
  code, line = _one_line(_bench(out), capsys)
  assert code == 2
  for word in words:
    assert word in line, line


# --- CRLF / CR text -----------------------------------------------------------------------------------------------

LF_TEXT = ("first doc\nwith two lines\n\nsecond doc\n\n\nthird, after two blank lines\n  \nstill third?\n\n"
           + "".join(f"doc {i}: line one\nline two of {i}\n\n" for i in range(40)))


@pytest.mark.parametrize("case", ["crlf", "cr", "mixed", "crlf-small-units", "cr-small-units", "mixed-small-units",
                                  "cr-bad-utf8", "crlf-raw-source"])
def test_crlf_and_cr_text_splits_as_lf_text_does(case, tmp_path):
  ending = case.split("-")[0]
  text = LF_TEXT + ("doc x\ncaf\udcff\n\n" if "bad-utf8" in case else "")
  lf = text.encode("utf-8", "surrogateescape")
  if ending == "mixed":  # line ends alternate CRLF, LF, CR (never CR then LF: that is one CRLF)
    parts, ends = lf.split(b"\n"), [b"\r\n", b"\n", b"\r"]
    other = b"".join(p + ends[i % 3] for i, p in enumerate(parts[:-1])) + parts[-1]
  else:
    other = lf.replace(b"\n", b"\r\n" if ending == "crlf" else b"\r")
  (tmp_path / "lf.txt").write_bytes(lf)
  (tmp_path / "other.txt").write_bytes(other)
  if "raw-source" in case:
    assert readers.read_documents(str(tmp_path / "other.txt")) == readers.read_documents(str(tmp_path / "lf.txt"))
    assert len(readers.read_documents(str(tmp_path / "lf.txt"))) == 43
    return
  shard_mb = 0.00005 if "small-units" in case else 64.0  # 52-byte units: cuts fall beside CRLFs too
  results = []
  for name in ("lf", "other"):
    try:
      prepare_lib.prepare([str(tmp_path / f"{name}.txt")], "byte", str(tmp_path / name), shard_mb=shard_mb,
                          progress=False)
    except Exception as e:  # noqa: BLE001 (the error, with its line number, is what is compared)
      results.append(str(e).replace(f"{name}.txt", "X"))
      continue
    m = json.loads((tmp_path / name / "manifest.json").read_text())
    results.append((m["documents"], m["tokens"], [np.load(tmp_path / name / s["files"]["tokens"]["name"]).tolist()
                                                  for s in m["shards"]]))
  if "bad-utf8" in case:
    line = lf[:lf.index(b"caf\xff")].count(b"\n") + 1
    assert f"X:{line}: invalid UTF-8" in results[0], results[0]
  else:
    assert results[0][0] == 43
  assert results[1] == results[0]


# --- what ran -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["one-shard-2-workers", "one-shard-8-workers", "3-shards-8-workers",
                                  "many-shards-2-workers", "many-shards-1-worker", "resumed-2-workers"])
def test_prepare_reports_the_workers_that_ran(case, tmp_path, capsys):
  n_docs, shard_mb = (20, 64.0) if case.startswith("one") else (60, 0.001) if case.startswith("many") else (30, 0.0007)
  workers = int(case.split("-")[-2])
  src = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts(n_docs)])
  argv = ["prepare", "--input", src, "--output", str(tmp_path / "o"), "--workers", str(workers),
          "--shard-mb", str(shard_mb)]
  if case.startswith("resumed"):
    prepare_lib.prepare([src], "byte", str(tmp_path / "o"), workers=1, shard_mb=shard_mb, progress=False)
    capsys.readouterr()
  assert data_command.main(argv) == 0
  line = capsys.readouterr().out.strip().splitlines()[-1]
  ran = int(line.split("(")[1].split(" shard")[0])  # shards this run
  assert ran == {"one": 1, "3-s": 3, "res": 0}.get(case[:3], ran) and (ran > 3 or not case.startswith("many")), line
  expected = ("nothing left to do" if case.startswith("resumed") else "1 worker, in this process"
              if workers == 1 or ran == 1 else f"{min(workers, ran)} worker processes")
  assert line.endswith(f"({ran} shard(s) this run, {expected})"), line


# --- a killed parent ----------------------------------------------------------------------------------------------

def _children(pid):
  """Pids whose parent is `pid` (from /proc)."""
  out = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/stat") as f:
          if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry))
      except (OSError, IndexError, ValueError):
        pass
  return out


def _alive(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
  except OSError:
    return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("case", ["at-the-first-write", "after-a-finished-shard"])
def test_helpers_of_a_killed_prepare_exit(case, tmp_path):
  r = np.random.default_rng(0)
  words = np.array(["alpha", "beta", "gamma", "delta", "\n"])
  with open(tmp_path / "big.txt", "w") as f:
    for _ in range(10):
      f.write("\n\n".join(" ".join(r.choice(words, 60)) for _ in range(4000)) + "\n\n")
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAXTRAIN_FAULTS")}
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.Popen([sys.executable, "-m", "jaxtrain.data", "prepare", "--input", str(tmp_path / "big.txt"),
                           "--output", str(tmp_path / "o"), "--workers", "2", "--shard-mb", "1"],
                          cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline, kids = time.monotonic() + 60, []
    while time.monotonic() < deadline and len(kids) < 3:  # the resource tracker and two workers
      time.sleep(0.2)
      kids = _children(proc.pid)
    assert len(kids) >= 3 and proc.poll() is None, kids
    pattern = "shard-*" if case == "at-the-first-write" else "shard-*.json"  # workers started; one done
    while time.monotonic() < deadline and not any((tmp_path / "o").glob(pattern)):
      time.sleep(0.05)
    assert proc.poll() is None
  finally:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
  deadline = time.monotonic() + 5
  while time.monotonic() < deadline and any(map(_alive, kids)):
    time.sleep(0.1)
  left = [k for k in kids if _alive(k)]
  for k in left:  # not to leave them running after a failure
    os.kill(k, signal.SIGKILL)
  assert not left, f"{len(left)} of {len(kids)} helper processes outlived their killed parent"


# --- a full disk --------------------------------------------------------------------------------------------------

def _failing_save(after, code=errno.ENOSPC):
  """np.save that writes `after` arrays, then writes part of the next and fails as a full disk does."""
  real, calls = np.save, [0]

  def save(f, array):
    calls[0] += 1
    if calls[0] > after:
      f.write(b"\x93NUMPY partial")
      raise OSError(code, os.strerror(code))
    real(f, array)
  return save


def _failing_fsync(name):
  """os.fsync that fails with ENOSPC for the file `name` (under its temporary name)."""
  real = os.fsync

  def fsync(fd):
    if os.readlink(f"/proc/self/fd/{fd}").endswith(name + ".tmp"):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    real(fd)
  return fsync


DISK_FULL = {  # case: (what fails, words of the one line, what is left)
    "first-shard": ("save:0", ["No space left on device (ENOSPC)", "nothing was kept"], "nothing"),
    "third-array": ("save:2", ["No space left on device (ENOSPC)", "kept 1 finished shard(s)"], "resumable"),
    "late-shard": ("save:7", ["No space left on device (ENOSPC)", "kept 3 finished shard(s)"], "resumable"),
    "quota": ("save:2:EDQUOT", ["Disk quota exceeded (EDQUOT)", "kept 1 finished shard(s)"], "resumable"),
    "job-file": ("fsync:prepare.json", ["No space left on device (ENOSPC)", "nothing was kept"], "nothing"),
    "shard-json": ("fsync:shard-00002.json", ["(ENOSPC)", "kept 2 finished shard(s)"], "resumable"),
    "manifest-of-a-rerun": ("fsync:manifest.json", ["(ENOSPC)", "the dataset that was there is untouched"],
                            "previous"),
    "manifest-new": ("fsync:manifest.json", ["(ENOSPC)", "finished shard(s)"], "resumable"),
}


@pytest.mark.parametrize("case", DISK_FULL)
def test_a_full_disk_during_prepare_is_one_line_and_keeps_what_is_whole(case, tmp_path, capsys, monkeypatch):
  docs = texts(60, seed=4)
  src = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in docs])
  prepare_lib.prepare([src], "byte", str(tmp_path / "ref"), shard_mb=0.001, progress=False)
  out = tmp_path / "o"
  argv = ["prepare", "--input", src, "--output", str(out), "--workers", "1", "--shard-mb", "0.001"]
  if case == "manifest-of-a-rerun":
    assert data_command.main(argv) == 0
  before = (out / "manifest.json").read_bytes() if out.exists() else None
  what, words, left = DISK_FULL[case]
  kind, arg, *code = what.split(":")
  if kind == "save":
    monkeypatch.setattr(prepare_lib.np, "save", _failing_save(int(arg), getattr(errno, code[0]) if code else
                                                               errno.ENOSPC))
  else:
    monkeypatch.setattr(files.os, "fsync", _failing_fsync(arg))
  code, line = _one_line(argv, capsys)
  monkeypatch.undo()
  assert code == 2
  for word in words:
    assert word in line, line
  assert not list(tmp_path.rglob("*.tmp")), list(tmp_path.rglob("*.tmp"))
  if left == "nothing":
    assert not out.exists()
  elif left == "previous":
    assert (out / "manifest.json").read_bytes() == before
  else:
    assert not (out / "manifest.json").exists()
  if left != "nothing":  # what was kept resumes to the dataset an undisturbed run makes
    assert data_command.main(argv) == 0
    assert (out / "manifest.json").read_text() == (tmp_path / "ref" / "manifest.json").read_text()


@pytest.mark.slow
def test_a_full_disk_in_a_worker_process_is_one_line(tmp_path, run_cli):
  """The workers are other processes: the fault is installed in each by a sitecustomize on their path."""
  hook = tmp_path / "hook"
  hook.mkdir()
  (hook / "sitecustomize.py").write_text(
      "import errno, os, numpy as np\n"
      "_real = np.save\n"
      "def _save(f, a):\n"
      "  if os.path.basename(f.name) == 'shard-00003.tokens.npy.tmp':\n"
      "    f.write(b'partial')\n"
      "    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
      "  _real(f, a)\n"
      "np.save = _save\n")
  write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts(60)])
  r = run_cli("jaxtrain.data", "prepare", "--input", "c.jsonl", "--output", "o", "--workers", "2", "--shard-mb",
              "0.001", env={"PYTHONPATH": f"{hook}{os.pathsep}{REPO}"}, timeout=120)
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert "No space left on device (ENOSPC)" in lines[0] and "finished shard(s)" in lines[0], lines[0]
  assert not list((tmp_path / "o").glob("*.tmp")) and not (tmp_path / "o" / "manifest.json").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mounts a small tmpfs")
@pytest.mark.parametrize("workers", [1, 2])
def test_a_really_full_filesystem_during_prepare_resumes_once_there_is_space(workers, tmp_path, capsys):
  """A 96 KiB tmpfs (where this process may mount one) fills up part way; then it is made larger and the same
  command finishes the dataset that an undisturbed run makes."""
  docs = texts(2000, seed=6, hi=60)
  src = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in docs])
  prepare_lib.prepare([src], "byte", str(tmp_path / "ref"), shard_mb=0.01, progress=False)
  disk = tmp_path / "disk"
  disk.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(disk)], capture_output=True).returncode:
    pytest.skip("cannot mount a tmpfs here")
  try:
    argv = ["prepare", "--input", src, "--output", str(disk / "o"), "--workers", str(workers), "--shard-mb", "0.01"]
    code, line = _one_line(argv, capsys)
    assert code == 2 and "No space left on device (ENOSPC)" in line and "finished shard(s)" in line, line
    assert not list(disk.rglob("*.tmp")) and not (disk / "o" / "manifest.json").exists()
    subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)
    assert data_command.main(argv) == 0
    assert (disk / "o" / "manifest.json").read_text() == (tmp_path / "ref" / "manifest.json").read_text()
  finally:
    subprocess.run(["umount", str(disk)], capture_output=True)
