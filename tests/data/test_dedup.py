"""`prepare --dedup exact|near`, `--min-chars/--max-chars`: planted duplicates found, counts in the manifest, the
same shards from any number of workers and after a resume."""

import json
import random

import numpy as np
import pytest

from jaxtrain.core.errors import UserError
from jaxtrain.data.tokenizer import ByteTokenizer
from jaxtrain.data.prepare import prepare
from tests.corpora import write_jsonl


def _corpus(n=30, words=150, seed=0):
  """n random documents of `words` words (pairwise far apart), then planted copies: exact ones that differ only in
  case and whitespace, near ones with two words changed, far ones with half the words changed; and short ones.
  Returns the texts and, per planted copy, its kind."""
  r = random.Random(seed)
  vocab = ["".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(r.randrange(3, 9))) for _ in range(3000)]
  docs = [" ".join(r.choice(vocab) for _ in range(words)) for _ in range(n)]
  planted = []
  for i in (2, 11, 27):
    planted.append(("exact", docs[i].upper().replace(" ", " \n\t ", 7)))
  for i in (5, 11, 20):
    w = docs[i].split()
    w[40], w[100] = "changedword", "another"
    planted.append(("near", " ".join(w)))
  w = docs[8].split()
  planted.append(("far", " ".join(x if k % 2 else "zz" + x for k, x in enumerate(w))))
  planted += [("short", "tiny"), ("short", "a few words")]
  out, kinds = list(docs), {}
  for kind, text in planted:  # interleaved into the second half, after their originals
    at = r.randrange(len(out) - 2, len(out) + 1)
    out.insert(at, text)
  kinds = {text: kind for kind, text in planted}
  return out, kinds


def _jaccard(a, b, n=5):
  grams = [{tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)} for ws in (a.lower().split(), b.lower().split())]
  return len(grams[0] & grams[1]) / len(grams[0] | grams[1])


def _stored_texts(directory):
  manifest = json.loads((directory / "manifest.json").read_text())
  out = []
  for shard in manifest["shards"]:
    tokens = np.load(directory / shard["files"]["tokens"]["name"])
    for start, length, _ in np.load(directory / shard["files"]["index"]["name"]):
      out.append(ByteTokenizer().decode(tokens[start + 1:start + length - 1]))  # less BOS and EOS
  return manifest, out


def _prepare(tmp_path, name, docs, **kw):
  src = write_jsonl(tmp_path / f"{name}.jsonl", [{"text": d} for d in docs])
  prepare([src], "byte", str(tmp_path / name), progress=False, shard_mb=0.004, **kw)
  return _stored_texts(tmp_path / name)


@pytest.mark.parametrize("mode", ["exact", "near"])
def test_planted_duplicates_are_dropped_and_counted(mode, tmp_path, capsys):
  docs, kinds = _corpus()
  assert all(_jaccard(docs[0], d) < 0.1 for d in docs[1:30])  # the originals are far apart
  dropped = {"exact"} | ({"near"} if mode == "near" else set())
  expected = [d for d in docs if kinds.get(d) not in dropped | {"short"}]
  manifest, stored = _prepare(tmp_path, mode, docs, dedup=mode, min_chars=20)
  assert stored == expected  # the first occurrence kept, in input order; the far copy kept
  assert manifest["skipped"]["duplicates"] == sum(kinds[d] in dropped for d in docs if d in kinds)
  assert manifest["skipped"]["too_short"] == 2 and manifest["documents"] == len(expected)
  assert manifest["filters"]["dedup"] == mode and manifest["filters"]["min_chars"] == 20
  assert f"{manifest['skipped']['duplicates']} duplicates" in capsys.readouterr().out
  # The near copies are near by the definition (true Jaccard of word 5-grams), the far one is not.
  near = [d for d in docs if kinds.get(d) == "near"]
  assert all(max(_jaccard(d, o) for o in docs[:30]) >= 0.8 for d in near)
  assert max(_jaccard(d, o) for o in docs[:30] for d in docs if kinds.get(d) == "far") < 0.5


def test_length_filters_count_characters(tmp_path):
  docs = ["x" * n for n in (1, 5, 9, 10, 11, 30, 31, 50)]
  manifest, stored = _prepare(tmp_path, "len", docs, min_chars=10, max_chars=30)
  assert stored == [d for d in docs if 10 <= len(d) <= 30]
  assert manifest["skipped"]["too_short"] == 3 and manifest["skipped"]["too_long"] == 2
  assert manifest["skipped"]["duplicates"] == 0 and manifest["filters"]["dedup"] == "none"


def test_dedup_is_the_same_with_three_workers_and_after_a_resume(tmp_path):
  docs, _ = _corpus(seed=4)
  m1, s1 = _prepare(tmp_path, "one", docs, dedup="near", workers=1)
  m3, s3 = _prepare(tmp_path, "three", docs, dedup="near", workers=3)
  assert len(m1["shards"]) > 5 and s1 == s3 and m1["skipped"] == m3["skipped"]
  for a, b in zip(m1["shards"], m3["shards"]):
    assert [f["sha256"] for f in a["files"].values()] == [f["sha256"] for f in b["files"].values()]
  # A resume re-makes a late shard from the same global decision (its duplicates' originals are in other shards).
  out, last = tmp_path / "one", len(json.loads((tmp_path / "one" / "prepare.json").read_text())["units"]) - 1
  first = (out / "manifest.json").read_text()
  (out / f"shard-{last:05d}.json").unlink()
  (out / "manifest.json").unlink()
  prepare([str(tmp_path / "one.jsonl")], "byte", str(out), progress=False, shard_mb=0.004, dedup="near")
  assert (out / "manifest.json").read_text() == first
  with pytest.raises(UserError, match="other inputs or options"):  # other filters into the same dir
    prepare([str(tmp_path / "one.jsonl")], "byte", str(out), progress=False, shard_mb=0.004, dedup="exact")


@pytest.mark.parametrize("kw, named", [
    ({"dedup": "fuzzy"}, "--dedup 'fuzzy'"), ({"min_chars": -1}, "--min-chars -1"),
    ({"min_chars": 9, "max_chars": 3}, "--min-chars 9 is above --max-chars 3"),
    ({"dedup": "exact", "near_threshold": 0.5}, "--near-threshold 0.5 applies to --dedup near"),
    ({"dedup": "near", "near_threshold": 1.5}, "--near-threshold 1.5: must be")])
def test_bad_filter_options_are_one_line(kw, named, tmp_path):
  src = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello"}])
  with pytest.raises(UserError, match=named.replace("'", ".")):
    prepare([src], "byte", str(tmp_path / "o"), progress=False, **kw)
  assert not (tmp_path / "o").exists()


def test_a_corpus_the_filters_empty_says_so(tmp_path):
  src = write_jsonl(tmp_path / "c.jsonl", [{"text": "short"}, {"text": "tiny"}])
  with pytest.raises(UserError, match="2 too_short dropped by the filters"):
    prepare([src], "byte", str(tmp_path / "o"), progress=False, min_chars=100)


def test_the_prepare_command_takes_the_filter_flags(tmp_path, capsys):
  from jaxtrain.data.__main__ import main
  src = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in ("Hello  World", "hello world", "hi", "x" * 50)])
  assert main(["prepare", "--input", src, "--output", str(tmp_path / "o"), "--dedup", "exact", "--min-chars", "3",
               "--max-chars", "40", "--workers", "1", "--no-progress"]) == 0
  manifest, stored = _stored_texts(tmp_path / "o")
  assert stored == ["Hello  World"]
  assert {k: manifest["skipped"][k] for k in ("duplicates", "too_short", "too_long")} == {
      "duplicates": 1, "too_short": 1, "too_long": 1}
  assert "filtered out 1 too short, 1 too long, 1 duplicates" in capsys.readouterr().out
