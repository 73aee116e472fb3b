"""Evaluation: the loss-only step against a plain reference, and eval records in the run."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import data
from jaxtrain.run import loop
from jaxtrain.core import config
from jaxtrain.run import step
from jaxtrain.core.errors import UserError
from tests.helpers import mesh_of


@pytest.mark.slow
def test_eval_step_is_the_token_mean_loss_on_a_sharded_mesh():
  cfg = config.load("tiny", ["model.dtype=float32", "train.microbatches=2", "data.eval_fraction=0.05"])
  setup = step.Setup(cfg, mesh_of("dp=2,tp=2"))
  params = setup.init()["params"]
  batch = data.eval_batches(cfg)[0]
  batch["loss_mask"][:, ::3] = 0  # uneven valid tokens per row
  got = jax.device_get(setup.eval_step(params, setup.device_batch(batch)))
  # Independent reference: one unsharded forward, log-softmax, mean over the valid targets.
  logits = nnx.merge(setup.graphdef, jax.device_get(params))(batch["inputs"], batch["positions"], batch["segment_ids"])
  nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1)[..., 0]
  mask = batch["loss_mask"]
  assert int(got["tokens"]) == int(mask.sum())
  np.testing.assert_allclose(got["loss"], float((nll * mask).sum() / mask.sum()), rtol=1e-5)
  np.testing.assert_allclose(got["loss_sum"], float((nll * mask).sum()), rtol=1e-5)


@pytest.mark.slow
def test_run_records_eval_loss_every_interval(tmp_path):
  cfg = config.load("tiny", ["train.steps=4", "train.eval_interval=2", "data.eval_fraction=0.05",
                             "data.eval_batches=2", "model.dtype=float32", "model.n_layers=1"])
  loop.run(cfg, mesh_of("dp=2"), tmp_path / "w", "tiny")
  records = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
  assert [("eval_loss" in r) for r in records] == [False, True, False, True]
  for r in records:
    assert r["data_wait_s"] >= 0
    if "eval_loss" in r:
      assert r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"]), rel=1e-5)
  assert records[3]["eval_loss"] < records[1]["eval_loss"]  # it learns, on data it never trained on


def test_eval_without_a_held_out_split_is_a_user_error(tmp_path):
  cfg = config.load("tiny", ["train.steps=1", "train.eval_interval=1"])
  with pytest.raises(UserError, match="train.eval_interval=1 needs a held-out split"):
    loop.run(cfg, mesh_of("dp=1"), tmp_path / "w", "tiny")
  with pytest.raises(UserError, match="fewer than data.eval_batches=50"):
    data.eval_batches(config.load("tiny", ["data.eval_fraction=0.01", "data.eval_batches=50"]))
