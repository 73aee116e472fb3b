"""`prepare`: token shards and manifest, the HF tokenizer, supervised masks, resume, bad input."""

import json

import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.core import config
from jaxtrain.core import files
from jaxtrain.data import tokenizer as tokenizer_lib
from jaxtrain.data.prepare import prepare
from jaxtrain.core.errors import UserError
from tests.corpora import prepared, texts, write_jsonl


def _docs_of(directory):
  """Every stored document, in input order, read straight from the shard files."""
  manifest = json.loads((directory / "manifest.json").read_text())
  out = []
  for shard in manifest["shards"]:
    tokens = np.load(directory / shard["files"]["tokens"]["name"])
    for start, length, train_from in np.load(directory / shard["files"]["index"]["name"]):
      out.append((tokens[start:start + length].astype(np.int64), int(train_from)))
  return manifest, out


def test_manifest_lists_sources_shards_and_counts(tmp_path):
  docs = texts(120)
  out = prepared(tmp_path, "c", docs, shard_mb=0.001)
  manifest, stored = _docs_of(tmp_path / "c")
  src = tmp_path / "c.jsonl"
  assert manifest["sources"][0]["bytes"] == src.stat().st_size
  assert manifest["sources"][0]["sha256"] == files.sha256_file(src)
  assert manifest["tokenizer"]["digest"] == data.ByteTokenizer.digest and manifest["dtype"] == "uint16"
  assert len(manifest["shards"]) > 3  # --shard-mb cut the input into several shards
  assert manifest["documents"] == len(docs) == len(stored)
  assert manifest["tokens"] == sum(len(d.encode()) + 2 for d in docs)
  tok = data.ByteTokenizer()
  for (ids, train_from), text in zip(stored, docs):
    np.testing.assert_array_equal(ids, tok.encode(text))
    assert train_from == 1
  for shard in manifest["shards"]:
    for entry in shard["files"].values():
      assert entry["sha256"] == files.sha256_file(tmp_path / "c" / entry["name"])
  assert data.source_digest(config.load("tiny", [f"data.source={out}"])) != data.source_digest(config.load("tiny"))


def test_several_worker_processes_and_parquet_give_the_same_shards(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  docs = texts(60, seed=3)
  prepared(tmp_path, "one", docs, shard_mb=0.001)
  prepared(tmp_path, "two", docs, shard_mb=0.001, workers=2)
  pq.write_table(pa.table({"body": docs}), tmp_path / "c.parquet", row_group_size=7)
  prepare([str(tmp_path / "c.parquet")], "byte", str(tmp_path / "pq"), text_field="body", progress=False,
          shard_mb=0.001)
  m1, d1 = _docs_of(tmp_path / "one")
  m2, d2 = _docs_of(tmp_path / "two")
  m3, d3 = _docs_of(tmp_path / "pq")
  assert [s["files"] for s in m1["shards"]] == [s["files"] for s in m2["shards"]]
  assert len(m3["shards"]) > 1 and m3["tokens"] == m1["tokens"]
  for (a, _), (b, _) in zip(d1, d3):
    np.testing.assert_array_equal(a, b)


def _train_bpe(tmp_path, corpus):
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
  path = tmp_path / "tokenizer.json"
  tok.save(str(path))
  return Tokenizer.from_file(str(path)), str(path)


def test_hf_tokenizer_trained_here_agrees_with_the_library(tmp_path):
  docs = texts(80, seed=5, alphabet="the quick brown fox jumps over lazy dogs ", hi=200)
  lib, path = _train_bpe(tmp_path, docs)
  out = prepared(tmp_path, "bpe", docs, tokenizer=path, shard_mb=0.002, workers=2)
  manifest, stored = _docs_of(tmp_path / "bpe")
  bos, eos = lib.token_to_id("<s>"), lib.token_to_id("</s>")
  assert manifest["tokenizer"]["bos_id"] == bos and manifest["tokenizer"]["eos_id"] == eos
  assert manifest["tokenizer"]["vocab_size"] == lib.get_vocab_size()
  for (ids, _), text in zip(stored, docs):
    assert ids.tolist() == [bos, *lib.encode(text, add_special_tokens=False).ids, eos]
  assert manifest["tokens"] < sum(len(d) for d in docs)  # BPE really merged something
  # Loading needs the same tokenizer in the config, and a digest that is the file's.
  cfg = config.load("tiny", [f"data.source={out}", f"data.tokenizer={path}"])
  assert data.tokenizer_digest(cfg) == manifest["tokenizer"]["digest"]
  assert next(data.batches(cfg))["inputs"].max() < lib.get_vocab_size()


def test_supervised_records_mask_the_prompt(tmp_path):
  recs = [{"q": "WHAT IS TWO", "a": "two"}, {"q": "", "a": "no prompt"}, {"q": "SAY", "a": ""}]
  src = write_jsonl(tmp_path / "sft.jsonl", recs)
  prepare([src], "byte", str(tmp_path / "sft"), prompt_field="q", completion_field="a", progress=False)
  manifest, stored = _docs_of(tmp_path / "sft")
  tok = data.ByteTokenizer()
  assert manifest["kind"] == "supervised"
  for (ids, train_from), rec in zip(stored, recs):
    np.testing.assert_array_equal(ids, tok.encode(rec["q"] + rec["a"]))
    assert train_from == max(1, 1 + len(rec["q"]))  # BOS + prompt bytes are never targets
  assert manifest["trainable_tokens"] == sum(len(r["a"]) + 1 for r in recs)  # completion + EOS


def test_an_interrupted_prepare_resumes_without_redoing_finished_shards(tmp_path):
  docs = texts(100, seed=9)
  out = tmp_path / "r"
  prepared(tmp_path, "r", docs, shard_mb=0.001)
  first = (out / "manifest.json").read_text()
  n_shards = len(json.loads(first)["shards"])
  # Simulate a kill: shard 2 never finished, and no manifest was written.
  (out / "shard-00002.json").unlink()
  (out / "shard-00002.tokens.npy").unlink()
  (out / "manifest.json").unlink()
  mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.npy")}
  prepare([str(tmp_path / "r.jsonl")], "byte", str(out), shard_mb=0.001, progress=False)
  assert (out / "manifest.json").read_text() == first
  redone = [n for n, t in mtimes.items() if (out / n).stat().st_mtime_ns != t]
  assert redone == ["shard-00002.index.npy"] and n_shards > 3
  with pytest.raises(UserError, match="prepared from other inputs or options"):
    prepare([str(tmp_path / "r.jsonl")], "byte", str(out), shard_mb=0.5, progress=False)


def _bad_jsonl(tmp_path, name, lines):
  path = tmp_path / name
  path.write_bytes(b"".join(lines))
  return str(path)


def test_bad_input_names_the_file_and_line(tmp_path):
  ok = b'{"text": "fine"}\n'
  cases = [
      ([str(tmp_path / "missing.jsonl")], "byte", "missing.jsonl' does not exist"),
      ([_bad_jsonl(tmp_path, "empty.jsonl", [])], "byte", "empty corpus"),
      ([_bad_jsonl(tmp_path, "blank.jsonl", [b'{"text": "  "}\n'])], "byte", "hold no documents: an empty corpus"),
      ([_bad_jsonl(tmp_path, "utf.jsonl", [ok, ok, b'{"text": "caf\xe9"}\n'])], "byte",
       r"utf.jsonl:3: invalid UTF-8 \(byte 0xe9\)"),
      ([_bad_jsonl(tmp_path, "field.jsonl", [ok, b'{"body": "x"}\n'])], "byte", "field.jsonl:2: no 'text' field"),
      ([_bad_jsonl(tmp_path, "json.jsonl", [ok, ok, ok, b'{"text": \n'])], "byte", "json.jsonl:4: invalid JSON"),
      ([_bad_jsonl(tmp_path, "t.csv", [ok])], "byte", "unsupported file type '.csv'"),
      ([_bad_jsonl(tmp_path, "c.txt", [b"first doc\n\nsecond\nline \xff\n"])], "byte", r"c.txt:4: invalid UTF-8"),
      ([_bad_jsonl(tmp_path, "a.jsonl", [ok])], str(tmp_path / "nope.json"), "nope.json' does not exist"),
  ]
  (tmp_path / "garbage.json").write_text("{not a tokenizer")
  cases.append(([_bad_jsonl(tmp_path, "b.jsonl", [ok])], str(tmp_path / "garbage.json"),
                "cannot be read as a Hugging Face tokenizer.json"))
  for i, (inputs, tok, words) in enumerate(cases):
    with pytest.raises(UserError, match=words):
      prepare(inputs, tok, str(tmp_path / f"out{i}"), progress=False)


def test_bad_records_may_be_skipped_but_are_counted_and_reported(tmp_path, capsys):
  lines = [b'{"text": "one"}\n', b'{"body": 1}\n', b'{"text": "two"}\n', b'{"text": "\xff"}\n', b'{"text": ""}\n']
  src = _bad_jsonl(tmp_path, "mixed.jsonl", lines)
  manifest = prepare([src], "byte", str(tmp_path / "ok"), max_bad_records=2, progress=False)
  assert manifest["documents"] == 2
  assert manifest["skipped"]["bad_records"] == 2 and manifest["skipped"]["empty_documents"] == 1
  assert "mixed.jsonl:2: no 'text' field" in manifest["skipped"]["examples"][0]
  assert "mixed.jsonl:4: invalid UTF-8" in manifest["skipped"]["examples"][1]
  assert "skipped 2 bad record(s) and 1 empty document(s)" in capsys.readouterr().out
  with pytest.raises(UserError, match=r"mixed.jsonl:4: invalid UTF-8.*more than --max-bad-records=1"):
    prepare([src], "byte", str(tmp_path / "strict"), max_bad_records=1, progress=False)


def test_loading_checks_shard_digests_and_the_tokenizer(tmp_path):
  out = prepared(tmp_path, "d", texts(30))
  _, path = _train_bpe(tmp_path, texts(30))
  with pytest.raises(UserError, match=r"prepared with tokenizer 'byte' .* but data.tokenizer=.*tokenizer.json"):
    data.batches(config.load("tiny", [f"data.source={out}", f"data.tokenizer={path}"]))
  shard = tmp_path / "d" / "shard-00000.tokens.npy"
  blob = bytearray(shard.read_bytes())
  blob[-1] ^= 1  # same size, one bit flipped
  shard.write_bytes(bytes(blob))
  with pytest.raises(UserError, match=r"shard .*shard-00000.tokens.npy: sha256 does not match the manifest"):
    data.batches(config.load("tiny", [f"data.source={out}"]))
  with pytest.raises(UserError, match="no manifest.json: not a prepared dataset"):
    data.batches(config.load("tiny", [f"data.source={tmp_path}"]))


def test_prepare_cli_reports_one_line_errors(run_cli, tmp_path):
  r = run_cli("jaxtrain.data", "prepare", "--input", "missing.jsonl", "--output", "o")
  assert r.returncode == 2
  assert r.stderr.strip().splitlines() == ["jaxtrain.data: error: input 'missing.jsonl' does not exist or is not a file"]
  write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts(40)])
  r = run_cli("jaxtrain.data", "prepare", "--input", "c.jsonl", "--output", "o", "--workers", "1")
  assert r.returncode == 0, r.stderr
  assert "prepared 40 documents" in r.stdout and "MB/s" in r.stdout
  assert r.stderr == ""  # the progress bar is drawn on a terminal only, never into a log
  r = run_cli("jaxtrain.data", "bench", "o", "--batches", "3", "--set", "train.seq_len=16", "--set", "train.batch_size=4")
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["tokens_per_sec"] == pytest.approx(3 * 4 * 16 / out["seconds"])


def test_a_utf8_byte_order_mark_is_read_as_no_part_of_the_text(tmp_path):
  """JSON Lines and plain text saved with a BOM (as Windows editors do) give the documents of the same file
  without one, in `prepare` and as a raw data.source; so do the text files a tokenizer folder holds."""
  bom = b"\xef\xbb\xbf"
  bodies = {"a.jsonl": b'{"text": "first"}\n{"text": "second"}\n', "a.txt": b"first\n\nsecond\n",
            "s.jsonl": b'{"q": "2+2=", "a": "4"}\n'}
  for name, body in bodies.items():
    kw = {"prompt_field": "q", "completion_field": "a"} if name == "s.jsonl" else {}
    for tag, blob in (("plain", body), ("bom", bom + body)):
      (tmp_path / tag).mkdir(exist_ok=True)
      (tmp_path / tag / name).write_bytes(blob)
      prepare([str(tmp_path / tag / name)], "byte", str(tmp_path / tag / f"{name}.out"), progress=False, **kw)
    plain, marked = (_docs_of(tmp_path / tag / f"{name}.out") for tag in ("plain", "bom"))
    assert marked[0]["skipped"]["bad_records"] == 0
    assert [(d.tolist(), t) for d, t in marked[1]] == [(d.tolist(), t) for d, t in plain[1]], name
    if name.startswith("a."):
      assert data.read_documents(str(tmp_path / "bom" / name)) == ["first", "second"]
  # the tokenizer folder's files: tokenizer.json and tokenizer_config.json (its EOS) with a BOM
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.train_from_iterator(["first second"] * 5, tokenizers.trainers.BpeTrainer(vocab_size=280,
                                                                               special_tokens=["<a>", "<b>"]))
  folder = tmp_path / "tok"
  folder.mkdir()
  (folder / "tokenizer.json").write_bytes(bom + tok.to_str().encode())
  (folder / "tokenizer_config.json").write_bytes(bom + json.dumps({"eos_token": "<b>"}).encode())
  loaded = tokenizer_lib.load(str(folder))
  assert loaded.eos_id == tok.token_to_id("<b>") and loaded.encode_batch(["first"])[0].tolist() == tok.encode(
      "first").ids


@pytest.mark.parametrize("flags, named", [
    (["--text-field", ""], "--text-field ''"), (["--chat-field", ""], "--chat-field ''"),
    (["--chat-field", " "], "--chat-field ' '"), (["--prompt-field", "", "--completion-field", "a"], "--prompt-field"),
    (["--prompt-field", "q", "--completion-field", ""], "--completion-field ''"),
    (["--prompt-field", "q", "--chosen-field", "", "--rejected-field", "r"], "--chosen-field ''"),
    (["--prompt-field", "q", "--chosen-field", "c", "--rejected-field", ""], "--rejected-field ''"),
    (["--prompt-field", "q", "--completion-field", "q"], "--prompt-field and --completion-field both name 'q'")])
def test_a_field_flag_naming_no_field_is_one_line(flags, named, tmp_path, capsys):
  """An empty field name (or one field for two roles) is refused, never read as the default text field."""
  from jaxtrain.data import __main__ as data_command
  src = write_jsonl(tmp_path / "r.jsonl", [{"text": "t", "q": "p", "a": "x", "c": "y", "r": "z", "m": []}])
  with pytest.raises(SystemExit) as e:
    data_command.main(["prepare", "--input", src, "--output", str(tmp_path / "o"), *flags])
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and len(err.splitlines()) == 1 and named in err, err
  assert not (tmp_path / "o").exists()


def test_an_empty_data_text_field_is_refused():
  with pytest.raises(UserError, match=r"data.text_field='': must name a field"):
    config.load("tiny", ["data.text_field="])
