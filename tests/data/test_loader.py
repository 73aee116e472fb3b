import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.core import config
from jaxtrain.core.errors import UserError


def test_fields_from_packed_rows():
  rows = {  # doc [5,6,7] then doc [8,9], then padding; seq_len + 1 = 7
      "tokens": np.array([[5, 6, 7, 8, 9, 0, 0]]),
      "tokens_segment_ids": np.array([[1, 1, 1, 2, 2, 0, 0]]),
      "tokens_positions": np.array([[0, 1, 2, 0, 1, 0, 0]]),
  }
  f = data.fields_from_rows(rows)
  np.testing.assert_array_equal(f["inputs"], [[5, 6, 7, 8, 9, 0]])
  np.testing.assert_array_equal(f["targets"], [[6, 7, 8, 9, 0, 0]])
  # 7 -> 8 crosses documents and 9 -> pad is padding: neither is trained on.
  np.testing.assert_array_equal(f["loss_mask"], [[1, 1, 0, 1, 0, 0]])
  np.testing.assert_array_equal(f["positions"], [[0, 1, 2, 0, 1, 0]])


def test_byte_tokenizer_round_trips():
  tok = data.ByteTokenizer()
  ids = tok.encode("héllo, wörld")
  assert ids[0] == tok.BOS and ids[-1] == tok.EOS and ids.max() < tok.vocab_size
  assert tok.decode(ids) == "héllo, wörld"


def _take(cfg, n, **kw):
  it = data.batches(cfg, **kw)
  out = [next(it) for _ in range(n)]
  it.close()
  return out


def test_batches_are_deterministic_by_seed_and_packed():
  cfg = config.load("tiny")
  a, b = _take(cfg, 3), _take(cfg, 3)
  for x, y in zip(a, b):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  c = _take(config.load("tiny", ["train.seed=1"]), 1)[0]
  assert not np.array_equal(a[0]["inputs"], c["inputs"])
  assert a[0]["inputs"].shape == (16, 128)
  assert (a[0]["segment_ids"].max(axis=1) > 1).any()  # rows really hold several documents
  assert a[0]["loss_mask"].mean() > 0.9  # packing leaves little padding


def test_process_slices_make_the_global_batch():
  cfg = config.load("tiny")
  whole = _take(cfg, 2)
  parts = [_take(cfg, 2, block=i, blocks=2) for i in range(2)]
  for s in range(2):
    for k in whole[s]:
      np.testing.assert_array_equal(np.concatenate([parts[0][s][k], parts[1][s][k]]), whole[s][k])


def test_bad_sources_are_user_errors(tmp_path):
  with pytest.raises(UserError, match="is not a file"):
    data.read_documents(str(tmp_path / "missing.jsonl"))
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"body": "x"}\n')
  with pytest.raises(UserError, match="bad.jsonl:1: no 'text' field"):
    data.read_documents(str(bad))
  txt = tmp_path / "c.txt"
  txt.write_text("first doc\n\nsecond doc\n")
  assert data.read_documents(str(txt)) == ["first doc", "second doc"]
