"""Token-normalized accumulation and the optimizer pieces of the train step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import data
from jaxtrain.core import config
from jaxtrain.model import transformer as model_lib
from jaxtrain.parallel import plan as plan_lib
from jaxtrain.run import step


def _setup():
  cfg = config.load("tiny", ["model.dtype=float32", "train.batch_size=8"])
  graphdef, _ = model_lib.abstract(cfg.model)
  params = nnx.to_pure_dict(nnx.state(model_lib.Transformer(cfg.model, nnx.Rngs(0))))
  batch = {k: jnp.asarray(v) for k, v in next(data.batches(cfg)).items()}
  # Uneven valid-token counts: microbatch i (rows i, i+4 with k=4) keeps a different share.
  keep = np.array([128, 3, 60, 0, 128, 17, 90, 1])[:, None] > np.arange(128)[None, :]
  batch["loss_mask"] = batch["loss_mask"] * jnp.asarray(keep, jnp.int32)
  return graphdef, params, batch


def test_accumulation_equals_one_big_batch():
  graphdef, params, batch = _setup()
  counts = [int(batch["loss_mask"][i::4].sum()) for i in range(4)]
  assert len(set(counts)) == 4, counts  # the microbatches really differ in valid tokens
  loss1, g1, n1 = jax.jit(step.grads, static_argnums=(0, 3))(graphdef, params, batch, 1)
  loss4, g4, n4 = jax.jit(step.grads, static_argnums=(0, 3))(graphdef, params, batch, 4)
  assert int(n1) == int(n4) == sum(counts)
  np.testing.assert_allclose(loss4, loss1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g4), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))


def test_loss_is_the_mean_over_valid_tokens_of_the_whole_update():
  graphdef, params, batch = _setup()
  loss, _, _ = step.grads(graphdef, params, batch, 4)
  # Independent reference: per-token NLL from log_softmax, averaged over all valid tokens.
  logits = nnx.merge(graphdef, params)(batch["inputs"], batch["positions"], batch["segment_ids"])
  nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1)[..., 0]
  mask = batch["loss_mask"]
  np.testing.assert_allclose(loss, (nll * mask).sum() / mask.sum(), rtol=1e-6)
  # The wrong contract (mean of per-microbatch means) gives a visibly different number.
  per_mb = [(nll[i::4] * mask[i::4]).sum() / mask[i::4].sum() for i in range(4) if mask[i::4].sum() > 0]
  assert abs(float(np.mean(per_mb)) - float(loss)) > 1e-3


def test_lr_schedule_warms_up_then_decays_to_the_floor():
  cfg = config.load("tiny", ["train.steps=100", "optim.warmup_steps=10", "optim.lr=1.0", "optim.min_lr_ratio=0.1"])
  lr = step.lr_schedule(cfg.optim, cfg.train.steps)
  np.testing.assert_allclose([lr(0), lr(4), lr(9)], [0.1, 0.5, 1.0], rtol=1e-6)
  np.testing.assert_allclose([lr(10), lr(55), lr(100)], [1.0, 0.55, 0.1], rtol=1e-5)


def test_weight_decay_mask_covers_projections_only():
  cfg = config.load("tiny")
  _, state = model_lib.abstract(cfg.model)
  mask = step.decay_mask(nnx.to_pure_dict(state))
  assert mask["layers"][0]["attn"]["wq"] and mask["layers"][1]["mlp"]["w_down"] and mask["lm_head"]
  assert not mask["embed"] and not mask["final_norm"]["scale"] and not mask["layers"][0]["attn_norm"]["scale"]


def test_grad_norm_is_logged_before_clipping():
  graphdef, params, batch = _setup()
  _, g, _ = step.grads(graphdef, params, batch, 1)
  unclipped = float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g))))
  cfg = config.load("tiny", ["model.dtype=float32", "train.batch_size=8", "optim.grad_clip=1e-3"])
  opt = step.optimizer(cfg)
  _, metrics = step.train_step(graphdef, opt, cfg, plan_lib.local(cfg.model), step.init_state(cfg, opt, params), batch)
  assert unclipped > 1.0 and float(metrics["grad_norm"]) == pytest.approx(unclipped, rel=1e-5)
