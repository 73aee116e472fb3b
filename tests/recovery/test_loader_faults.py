"""Issue 40 item 5, loader faults: a batch the data pipeline cannot produce is one line naming the source and the
step; the run stops at a committed point (the last completed step, saved with the data state of the failed
fetch), and the same command goes on with exactly the batches of an uninterrupted run.

The fault is injected in the loader's worker thread (`JAXTRAIN_FAULTS=loader_fail_at=STEP`, run/faults.py), so
the error travels grain's real path to the loop."""

import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.core import config
from jaxtrain.run import checkpoint
from tests.helpers import clean_env
from tests.recovery.test_recovery import SETS, ok, one_line, records, train


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  return clean_env(JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jit-cache")),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
                   PYTHONUNBUFFERED="1")


@pytest.fixture(scope="module")
def uninterrupted(env, tmp_path_factory):
  """An independent reference run of 6 steps, never faulted."""
  w = tmp_path_factory.mktemp("uninterrupted") / "w"
  ok(train(env, w, "--steps", "6"))
  return records(w)


def bit_for_bit(got, ref, steps):
  assert sorted(got) == list(steps), sorted(got)
  for s in steps:
    assert (got[s]["loss"], got[s]["grad_norm"]) == (ref[s]["loss"], ref[s]["grad_norm"]), s


@pytest.mark.slow
@pytest.mark.parametrize("fault_at, committed", [(4, [2, 3]), (3, [2])])  # 3: step 2 was already saved (interval 2)
def test_loader_fault_commits_the_last_step_and_the_rerun_is_the_uninterrupted_run(
    env, uninterrupted, tmp_path, fault_at, committed):
  w = tmp_path / "w"
  r = train(env, w, "--steps", "6", faults=f"loader_fail_at={fault_at}")
  line = one_line(r, 1)  # not 2: the data broke, not the user's input
  done = fault_at - 1
  assert line.startswith(f"jaxtrain: error: the data pipeline failed on the batch of step {fault_at} "
                         "(data source 'bundled'): OSError: [Errno 5] Input/output error"), line
  assert f"checkpoint {done} is committed; run the same command to resume" in line, line
  assert "Traceback" not in r.stdout + r.stderr
  assert "SourceError" in (w / "jaxtrain.log").read_text()  # the traceback from the worker thread, in the log
  assert checkpoint.committed_steps(w / "checkpoints") == committed
  manifest = checkpoint.read_manifest(w / "checkpoints" / str(done))
  assert manifest["progress"]["step"] == done and manifest["data_state"]["step"] == done  # before the failed fetch
  bit_for_bit(records(w), uninterrupted, range(1, fault_at))

  r = ok(train(env, w, "--steps", "6"))
  assert f"at step {done}" in r.stdout
  bit_for_bit(records(w), uninterrupted, range(1, 7))  # no batch skipped or repeated


@pytest.mark.slow
def test_loader_fault_at_the_first_batch_says_there_was_nothing_to_commit(env, uninterrupted, tmp_path):
  w = tmp_path / "w"
  line = one_line(train(env, w, "--steps", "6", faults="loader_fail_at=1"), 1)
  assert "failed on the batch of step 1 (data source 'bundled')" in line, line
  assert "no step had run: nothing to commit; run the same command to start again" in line, line
  assert checkpoint.committed_steps(w / "checkpoints") == []
  ok(train(env, w, "--steps", "6"))
  bit_for_bit(records(w), uninterrupted, range(1, 7))


def test_a_failed_fetch_leaves_the_iterator_at_that_batch(monkeypatch):
  cfg = config.load("tiny", SETS[:3])
  ref = data.batches(cfg)
  want = [next(ref) for _ in range(4)]
  ref.close()
  monkeypatch.setenv("JAXTRAIN_FAULTS", "loader_fail_at=3")
  it = data.batches(cfg)
  try:
    for b in want[:2]:
      assert all(np.array_equal(b[k], v) for k, v in next(it).items())
    with pytest.raises(data.LoaderError, match=r"batch of step 3 \(data source 'bundled'\): OSError"):
      next(it)
    assert it.get_state()["step"] == 2  # a checkpoint now makes the rerun fetch batch 3 again
    monkeypatch.delenv("JAXTRAIN_FAULTS")
    for b in want[2:]:  # the same iterator, retried: a fresh grain iterator at the failed batch
      assert all(np.array_equal(b[k], v) for k, v in next(it).items())
  finally:
    it.close()


def test_a_fault_outside_a_source_names_the_configured_sources(monkeypatch):
  from jaxtrain.data import pipeline

  def broken(rows):
    raise ValueError("a transform bug")
  monkeypatch.setattr(pipeline, "fields_from_rows", broken)
  it = data.batches(config.load("tiny", SETS[:3]))
  try:
    with pytest.raises(data.LoaderError, match=r"batch of step 1 \(data.source 'bundled'\): ValueError: a transform"):
      next(it)
  finally:
    it.close()
