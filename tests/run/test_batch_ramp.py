"""train.batch_ramp and the schedule in tokens (train.tokens, optim.warmup_tokens, optim.lr_reference_batch),
against references computed here: the ramp's step sizes by hand from its thresholds, each step's rows from the
one-row-a-step stream of the corpus, each step's learning rate from the formula below on the valid tokens of the
batches, and the run itself against an uninterrupted run (resume) and against one device (dp=2).

    T = valid tokens of the applied updates before this one + this update's valid tokens
    T < W: lr * T / W;  else lr * (m + (1 - m) * 0.5 * (1 + cos(pi * min((T - W) / (N - W), 1))))
    times sqrt(batch / reference) (optim.lr_batch_scaling=sqrt), or batch / reference (linear)

W: optim.warmup_tokens, N: train.tokens, m: optim.min_lr_ratio."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.core import config, ramp
from jaxtrain.core.errors import UserError
from jaxtrain.run import checkpoint, loop, step
from tests.helpers import mesh_of

# 32 tokens a row: 4 rows (128 tokens) a step until 300 tokens are fed (after step 3), then 8 rows; train.tokens
# 1500 = 3 x 128 + 5 x 256 (1664 >= 1500 > 1408): 8 steps.
RAMP = ["model.dtype=float32", "train.seq_len=32", "train.batch_ramp=0:4,300:8", "train.tokens=1500",
        "optim.warmup_tokens=300", "optim.lr_reference_batch=4", "optim.lr_batch_scaling=sqrt", "run.trackers=",
        "data.workers=0", "checkpoint.interval=0", "optim.lr=1e-2", "optim.min_lr_ratio=0.1"]
SIZES = [4, 4, 4, 8, 8, 8, 8, 8]  # by hand from the thresholds above


def _lr(T, o, total, rows):
  if T < o.warmup_tokens:
    base = o.lr * T / o.warmup_tokens
  else:
    p = min((T - o.warmup_tokens) / (total - o.warmup_tokens), 1.0)
    base = o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))
  r = rows / o.lr_reference_batch
  return base * (math.sqrt(r) if o.lr_batch_scaling == "sqrt" else r)


def test_the_ramp_sizes_each_step_by_the_tokens_fed_before_it():
  cfg = config.load("tiny", RAMP)
  assert cfg.train.batch_size == 8  # the ramp's largest, filled in
  r = ramp.of(cfg)
  assert [r.size(s) for s in range(8)] == SIZES
  assert [r.rows_before(s) for s in range(9)] == [sum(SIZES[:s]) for s in range(8)] + [sum(SIZES)]
  assert ramp.run_steps(cfg) == 8
  # a step that feeds past two thresholds: 0:4,100:8,120:16 at 32 tokens a row: 4 (128 fed), then 16; size 8
  # never runs; 640 tokens fed after two steps, 1152 after three
  r = ramp.build("0:4,100:8,120:16", 16, 32)
  assert [r.size(s) for s in range(4)] == [4, 16, 16, 16] and r.sizes() == (4, 16)
  assert (r.steps_for(640), r.steps_for(641), r.steps_for(0)) == (2, 3, 1)


def test_each_step_takes_the_next_rows_of_the_corpus_stream_whatever_the_split():
  """Step s's global batch is rows sum(SIZES[:s]) .. + SIZES[s] of the stream a batch of one row a step reads;
  the two halves (two processes' blocks) put together are that batch."""
  cfg = config.load("tiny", RAMP)
  one = data.batches(config.load("tiny", [*RAMP[:2], "train.batch_size=1", "data.workers=0"]))
  stream = [next(one) for _ in range(sum(SIZES))]
  one.close()
  whole, halves = data.batches(cfg), [data.batches(cfg, b, 2) for b in (0, 1)]
  for s, size in enumerate(SIZES):
    got = next(whole)
    parts = [next(h) for h in halves]
    start = sum(SIZES[:s])
    for k in got:
      want = np.concatenate([row[k] for row in stream[start:start + size]])
      np.testing.assert_array_equal(got[k], want, err_msg=f"step {s + 1} {k}")
      np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), want)
  for it in (whole, *halves):
    it.close()


def _run(tmp_path, name, spec="dp=1", stop_at=None):
  cfg = config.load("tiny", RAMP)
  summary = loop.run(cfg, mesh_of(spec), tmp_path / name, "tiny", stop_at=stop_at)
  recs = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
  return summary, {r["step"]: r for r in recs}


def _params(step_dir):
  setup = step.Setup(config.load("tiny", RAMP), mesh_of("dp=1"))
  ck = checkpoint.Checkpoints(step_dir.parent, 3, 0, False)
  state, _ = ck.restore(step_dir, setup.abstract_state())
  ck.mgr.close()
  return jax.device_get(state)


@pytest.mark.slow  # three in-process runs, two step programs each (about a minute on 2 cores)
def test_a_ramp_run_resumed_mid_ramp_equals_the_uninterrupted_run_and_dp2_equals_one_device(tmp_path):
  cfg = config.load("tiny", RAMP)
  straight, ref = _run(tmp_path, "straight")
  assert straight.compiled_sizes == [4, 8]  # each size's step compiled once
  assert [ref[s]["batch_size"] for s in range(1, 9)] == SIZES
  # the LR of each step from the valid tokens of the batches it saw (the stream itself, read here)
  it, T = data.batches(cfg), 0
  for s in range(1, 9):
    n = int(next(it)["loss_mask"].sum())
    assert ref[s]["tokens"] == n and not ref[s]["skipped"]
    T += n
    assert ref[s]["lr"] == pytest.approx(_lr(T, cfg.optim, cfg.train.tokens, SIZES[s - 1]), rel=1e-5), s
  it.close()
  _run(tmp_path, "resumed", stop_at=2)  # stops in the first size, resumes into the second
  again, got = _run(tmp_path, "resumed")
  assert again.compiled_sizes == [4, 8] and sorted(got) == list(range(1, 9))
  for s in range(3, 9):
    assert {k: got[s][k] for k in ("loss", "grad_norm", "lr")} == {k: ref[s][k] for k in ("loss", "grad_norm", "lr")}
  a, b = _params(tmp_path / "resumed" / "checkpoints" / "8"), _params(tmp_path / "straight" / "checkpoints" / "8")
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  assert int(a["tokens"][0]) * 2**30 + int(a["tokens"][1]) == T  # the schedule's position, carried over
  _, dp2 = _run(tmp_path, "dp2", spec="dp=2")
  for s in range(1, 9):
    for k in ("loss", "grad_norm", "lr"):
      assert dp2[s][k] == pytest.approx(ref[s][k], rel=1e-5), (s, k)


def test_a_skipped_update_moves_the_token_schedule_by_nothing():
  """Three batches; the second meets a NaN parameter (non-finite gradients, valid tokens): skipped, the tokens
  counter unmoved, and the third update's LR is the formula at the first's tokens plus the third's."""
  cfg = config.load("tiny", ["model.dtype=float32", "train.seq_len=32", "train.batch_size=4", "train.tokens=2000",
                             "optim.warmup_tokens=1000", "data.workers=0"])
  setup = step.Setup(cfg, mesh_of("dp=1"))
  it = data.batches(cfg)
  b1, b2, b3 = (next(it) for _ in range(3))
  it.close()
  n1, n3 = int(b1["loss_mask"].sum()), int(b3["loss_mask"].sum())
  state, m1 = setup.step(setup.init(), setup.device_batch(b1))
  good = jax.tree.map(jnp.array, state["params"])
  state["params"] = jax.tree.map(lambda x: x * jnp.nan, state["params"])
  state, m2 = setup.step(state, setup.device_batch(b2))
  assert bool(m2["skipped"]) and int(b2["loss_mask"].sum()) > 0 and list(np.asarray(state["tokens"])) == [0, n1]
  state["params"] = good
  state, m3 = setup.step(state, setup.device_batch(b3))
  assert not bool(m3["skipped"]) and list(np.asarray(state["tokens"])) == [0, n1 + n3]
  o = cfg.optim
  assert float(m1["lr"]) == pytest.approx(o.lr * n1 / 1000, rel=1e-6)
  assert float(m3["lr"]) == pytest.approx(o.lr * (n1 + n3) / 1000, rel=1e-6)


@pytest.mark.parametrize("sets, words", [
    (["train.tokens=1e3", "train.steps=30"], ("train.steps=30", "train.tokens=1000 ", "give one")),
    (["train.tokens=1000", "optim.warmup_steps=3", "optim.warmup_tokens=10"], ("optim.warmup_steps=3",
                                                                              "optim.warmup_tokens=10")),
    (["optim.warmup_tokens=100"], ("optim.warmup_tokens=100", "train.tokens")),
    (["train.batch_ramp=0:4,1e3:8", "train.batch_size=4"], ("train.batch_size=4", "largest size 8")),
    (["train.batch_ramp=10:4"], ("train.batch_ramp='10:4'", "start at 0")),
    (["train.batch_ramp=0:8,5:4,5:16"], ("train.batch_ramp=", "rise strictly")),
    (["train.batch_ramp=0:4,1e3:x"], ("train.batch_ramp=", "'1e3:x'")),
    (["train.batch_ramp=0:5,1e3:8", "train.microbatches=2", "train.batch_size=8"], ("size 5", "microbatches=2")),
])
def test_bad_schedules_are_refused_in_one_line(sets, words):
  with pytest.raises(UserError) as e:
    config.load("tiny", sets)
  assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)


def test_a_later_layer_replaces_the_other_spelling_and_a_ramp_size_must_fit_the_mesh(tmp_path):
  toml = tmp_path / "c.toml"
  toml.write_text('[train]\nsteps = 50\nbatch_size = 16\n[optim]\nwarmup_steps = 7\n')
  cfg = config.load(str(toml), ["train.tokens=4096", "optim.warmup_tokens=512", "train.batch_ramp=0:2,1e3:4"])
  assert (cfg.train.steps, cfg.optim.warmup_steps, cfg.train.batch_size) == (20, 5, 4)  # back to the defaults
  with pytest.raises(UserError, match=r"train.batch_ramp size 2 / train.microbatches=1 = 2 sequences per "
                                      r"microbatch must divide over data\*fsdp\*expert=4"):
    step.Setup(config.load("tiny", ["train.batch_ramp=0:2,1e3:8"]), mesh_of("dp=4"))


def test_a_resume_cannot_switch_the_schedule_between_steps_and_tokens(tmp_path):
  """Even with --allow-mismatch train: the state holds the position in tokens only when the schedule is."""
  steps_cfg, tokens_cfg = config.load("tiny"), config.load("tiny", ["train.tokens=1e6"])
  for was, now, words in ((steps_cfg, tokens_cfg, ("in steps", "in tokens (train.tokens=1e+06)")),
                          (tokens_cfg, steps_cfg, ("in tokens (train.tokens=1e+06)", "in steps"))):
    accept = loop._same_run(checkpoint.fingerprint(now, "tok", "data"), {"train"}, step.Setup(now, mesh_of("dp=1")))
    with pytest.raises(UserError) as e:
      accept(tmp_path / "7", {"fingerprint": checkpoint.fingerprint(was, "tok", "data")})
    msg = str(e.value)
    assert msg.index(words[0]) < msg.index(words[1]) and "\n" not in msg and "--fresh" in msg, msg
