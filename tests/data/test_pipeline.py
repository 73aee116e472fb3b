"""The loader: exact epochs, packing fields, seeds, host-count independence, resume, mixtures."""

import json

import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.core import config
from jaxtrain.data.prepare import prepare
from jaxtrain.core.errors import UserError
from tests.corpora import prepared, texts, write_jsonl

L, B = 16, 4
tok = data.ByteTokenizer()


def _cfg(source, *more):
  return config.load("tiny", [f"data.source={source}", f"train.seq_len={L}", f"train.batch_size={B}", *more])


def _take(cfg, n, **kw):
  it = data.batches(cfg, **kw)
  out = [next(it) for _ in range(n)]
  it.close()
  return out


def _rows(batches):
  return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def test_one_epoch_holds_every_token_exactly_once(tmp_path):
  docs = texts(50, seed=1, hi=60)  # several documents are longer than a row of 16
  out = prepared(tmp_path, "c", docs, shard_mb=0.0005)
  T = sum(len(d.encode()) + 2 for d in docs)
  rows_per_epoch = -(-(T - 1) // L)
  got = _rows(_take(_cfg(out), -(-2 * rows_per_epoch // B)))
  for e in range(2):
    epoch = {k: v[e * rows_per_epoch:(e + 1) * rows_per_epoch] for k, v in got.items()}
    # Rows overlap by one token: the first input, then every target, is the epoch's stream.
    stream = np.concatenate([epoch["inputs"][:1, 0], epoch["targets"].reshape(-1)])
    assert (epoch["inputs"][1:, 0] == epoch["targets"][:-1, -1]).all()
    pad = len(stream) - T
    assert 0 <= pad < L and (stream[T:] == tok.PAD).all()
    stream = stream[:T]
    # Split at BOS: each document comes back whole, exactly once.
    starts = np.flatnonzero(stream == tok.BOS)
    pieces = [tok.decode(p) for p in np.split(stream, starts[1:])]
    assert sorted(pieces) == sorted(docs)
    # Every token but each document's BOS is a target exactly once, and counts in the loss.
    assert int(epoch["loss_mask"].sum()) == T - len(docs)
    if e == 0:
      first_order = pieces
  assert pieces != first_order  # the next epoch is reshuffled


def test_segment_ids_and_positions_follow_the_documents():
  (b,) = _take(config.load("tiny"), 1)
  for inp, seg, pos, mask in zip(b["inputs"], b["segment_ids"], b["positions"], b["loss_mask"]):
    ids = np.unique(seg[seg > 0])
    assert ids.tolist() == list(range(1, len(ids) + 1))  # 1, 2, ... in order, 0 only for padding
    for s in ids:
      at = np.flatnonzero(seg == s)
      assert (np.diff(at) == 1).all()  # a segment is contiguous
      assert (np.diff(pos[at]) == 1).all()  # positions count up within it
      assert pos[at[0]] == 0 if inp[at[0]] == tok.BOS else pos[at[0]] > 0  # restart only at a document start
      assert mask[at[-1]] == (at[-1] == len(seg) - 1)  # the last token of a segment predicts the next only if continuing


def test_supervised_loss_mask_is_exactly_the_completion(tmp_path):
  # Prompts are upper case, completions lower case: the mask must be 1 exactly on
  # lower-case and EOS targets; never on prompt, BOS or padding targets.
  recs = [{"p": "".join("ABCDEFG"[(i * j) % 7] for j in range(i % 9)), "c": "xyz" * (1 + i % 5)} for i in range(25)]
  src = write_jsonl(tmp_path / "sft.jsonl", recs)
  prepare([src], "byte", str(tmp_path / "sft"), prompt_field="p", completion_field="c", progress=False)
  total = sum(len(r["p"]) + len(r["c"]) + 2 for r in recs)
  n = -(-(total - 1) // L)
  b = _rows(_take(_cfg(tmp_path / "sft"), -(-n // B)))
  tgt, mask = b["targets"][:n], b["loss_mask"][:n]
  completion = ((tgt >= ord("a") + tok.OFFSET) & (tgt <= ord("z") + tok.OFFSET)) | (tgt == tok.EOS)
  np.testing.assert_array_equal(mask, completion.astype(np.int32))
  assert tgt[n - 1, -1] == tok.PAD and mask[n - 1, -1] == 0  # the epoch's last row ends in masked padding
  # step.grads normalizes by (loss_mask > 0).sum(): the completion tokens, nothing else.


def test_same_seed_same_batches_other_seed_other_batches(tmp_path):
  out = prepared(tmp_path, "c", texts(80))
  a, b = _take(_cfg(out), 3), _take(_cfg(out), 3)
  for x, y in zip(a, b):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  c = _take(_cfg(out, "train.seed=1"), 1)[0]
  assert not np.array_equal(a[0]["inputs"], c["inputs"])


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
  """Two prepared datasets with disjoint alphabets, so a row's dataset shows in its bytes."""
  tmp = tmp_path_factory.mktemp("mix")
  a = prepared(tmp, "a", texts(300, seed=1, alphabet="abcdefgh"))
  b = prepared(tmp, "b", texts(300, seed=2, alphabet="stuvwxyz"))
  return f"{a},{b}"


def _global(cfg, n, processes):
  parts = [_take(cfg, n, block=i, blocks=processes) for i in range(processes)]
  return [{k: np.concatenate([p[s][k] for p in parts]) for k in parts[0][s]} for s in range(n)]


def _same(xs, ys):
  assert len(xs) == len(ys)
  for x, y in zip(xs, ys):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_one_and_two_processes_see_the_same_global_batches(mixture):
  cfg = _cfg(mixture, "data.weights=3,1")
  _same(_global(cfg, 4, 1), _global(cfg, 4, 2))


@pytest.mark.parametrize("state_keys", [("version", "step", "rows_per_source"), ("step",)])
def test_resume_onto_another_process_count_continues_exactly(mixture, state_keys):
  cfg = _cfg(mixture, "data.weights=3,1")
  k, n = 3, 7
  want = _global(cfg, n, 1)
  # Two processes run k steps; their states agree and are plain JSON.
  its = [data.batches(cfg, i, 2) for i in range(2)]
  head = [[next(it) for _ in range(k)] for it in its]
  states = [json.loads(json.dumps(it.get_state())) for it in its]
  assert states[0] == states[1] and states[0]["step"] == k
  for it in its:
    it.close()
  state = {key: states[0][key] for key in state_keys}
  # ... and the run resumes on four processes (a fresh loader each, as after a restart).
  resumed = []
  for i in range(4):
    it = data.batches(cfg, i, 4)
    it.set_state(state)
    resumed.append([next(it) for _ in range(n - k)])
    it.close()
  got = [{key: np.concatenate([h[s][key] for h in head]) for key in head[0][s]} for s in range(k)]
  got += [{key: np.concatenate([r[s][key] for r in resumed]) for key in resumed[0][s]} for s in range(n - k)]
  _same(got, want)


def test_mixture_proportions_follow_the_weights(mixture):
  rows = _rows(_take(_cfg(mixture, "data.weights=0.8,0.2", "data.workers=0"), 300))
  body = np.where(rows["inputs"] >= ord("a") + tok.OFFSET, rows["inputs"], 0)
  from_a = (body > 0) & (body <= ord("h") + tok.OFFSET)
  from_b = body >= ord("s") + tok.OFFSET
  assert not (from_a.any(1) & from_b.any(1)).any()  # a row never mixes the two datasets
  share_a = from_a.any(1).sum() / (from_a.any(1) | from_b.any(1)).sum()
  assert abs(share_a - 0.8) < 0.04, share_a  # 1,200 rows: 0.04 is about 4 standard deviations
  with pytest.raises(UserError, match="data.weights='1' must hold 2 positive number"):
    data.batches(_cfg(mixture, "data.weights=1"))


def test_held_out_split_is_disjoint_and_fixed(tmp_path):
  docs = texts(200, seed=4)
  out = prepared(tmp_path, "c", docs)
  cfg = _cfg(out, "data.eval_fraction=0.1", "data.eval_batches=2")
  held = data.eval_batches(cfg)
  assert len(held) == 2 and held[0]["inputs"].shape == (B, L)
  for a, b in zip(held, data.eval_batches(_cfg(out, "data.eval_fraction=0.1", "data.eval_batches=2",
                                                 "train.seed=5"))):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])  # the same whatever the train seed
  train_docs = {t.split(":")[0] for t in _decoded_docs(_take(cfg, 60))}
  held_docs = {t.split(":")[0] for t in _decoded_docs(held)}
  assert held_docs and len(train_docs) > 50 and not held_docs & train_docs
  with pytest.raises(UserError, match="needs a held-out split"):
    data.eval_batches(_cfg(out, "train.eval_interval=5"))


def _decoded_docs(batches):
  """Numbered prefixes of the documents that start in these consecutive rows (the rows
  overlap by one token, so the first input and then all targets are the token stream)."""
  rows = _rows(batches)
  stream = np.concatenate([rows["inputs"][:1, 0], rows["targets"].reshape(-1)])
  pieces = np.split(stream, np.flatnonzero(stream == tok.BOS))
  return [tok.decode(p) for p in pieces[1:] if ":" in tok.decode(p)]


def _most_in_rows(batches) -> int:
  seg = np.concatenate([b["segment_ids"] for b in batches])
  return int((1 + (seg[:, 1:] != seg[:, :-1]).sum(axis=1)).max())


@pytest.mark.parametrize("sets,steps", [((), 30), (("data.weights=3,1",), 30), (("train.seq_len=40",), 12),
                                        (("data.eval_fraction=0.2", "data.eval_batches=3"), 40)])
def test_most_segments_is_the_most_the_loaders_rows_hold(mixture, sets, steps):
  """The count the attention path is planned from (`data.most_segments`) against every row the loader gives for
  those steps (and the eval batches): never fewer (a row the kernel cannot hold), and exactly the most seen where
  the rows counted are the rows given (one source, steps counted in full epochs)."""
  source = mixture.split(",")[0] if not sets or "weights" not in sets[0] else mixture
  cfg = _cfg(source, *sets)
  seen = _most_in_rows(_take(cfg, steps))
  if cfg.data.eval_fraction:
    seen = max(seen, _most_in_rows(data.eval_batches(cfg)))
  counted = data.most_segments(cfg, steps)
  assert counted >= seen >= 2
  if "," not in source:
    assert counted == seen
  assert data.most_segments(cfg, steps + 200) >= counted  # a longer run: at least as many


def test_most_segments_of_long_documents_is_one_and_of_a_long_run_a_bound_for_any_order(tmp_path):
  """Rows that each hold one document (every document longer than the row) need causal attention alone; past the
  epochs counted one by one, the bound is what the shortest documents side by side give."""
  long_docs = prepared(tmp_path, "long", ["x" * 500 + str(i) for i in range(3)])
  cfg = _cfg(long_docs, "train.seq_len=600", "train.batch_size=1")
  assert data.most_segments(cfg, 1) == 2  # a window over a document boundary: the next document, or padding
  cfg = _cfg(prepared(tmp_path, "one", ["y" * 2000]), "train.seq_len=100", "train.batch_size=2")
  assert data.most_segments(cfg, 5) == 1 == _most_in_rows(_take(cfg, 5))  # one document, rows inside it
  short = prepared(tmp_path, "short", ["ab", "cde", "fghi"] + ["z" * 50 + str(i) for i in range(4)])
  cfg = _cfg(short, "train.seq_len=16", "train.batch_size=4")
  from jaxtrain.data import pipeline
  ts = pipeline.open_sources(cfg)[0][0]
  rows = (pipeline.EXACT_EPOCHS + 1) * -(-(ts.n_tokens - 1) // 16)  # one epoch past those counted
  # the shortest documents side by side: two ends of 1 token around whole documents within 16 - 2 tokens, padding
  whole = int((np.cumsum(np.sort(ts.lengths)) <= 16 - 2).sum())
  assert sorted(ts.lengths)[:3] == [4, 5, 6] and whole == 2  # "ab", "cde", "fghi" with BOS and EOS
  assert pipeline.packer(ts, 16, 0, 0).most_segments(rows) == 1 + whole + 1 + 1
