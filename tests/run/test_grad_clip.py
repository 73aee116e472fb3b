"""Global-norm gradient clipping, done by the optimizer (`optimizer.optimizer`): the clipped
gradient against a hand-written numpy clip, the state layout it leaves alone, and the
train step clipping the unscaled gradient (any loss scale gives the same update)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import data
from jaxtrain.core import config
from jaxtrain.model import transformer as model_lib
from jaxtrain.run import optimizer as optim_lib, step
from tests.helpers import grads_of, mesh_of

# b1=b2=0: Adam's m=g, v=g^2, so with eps=1 the update is -lr * g / (|g| + 1): it depends on the
# gradient's scale, so a clip shows. warmup=1: the first update runs at lr. No weight decay.
PROBE = ["optim.lr=0.5", "optim.warmup_steps=1", "optim.b1=0", "optim.b2=0", "optim.eps=1.0",
         "optim.weight_decay=0"]
G = {"wq": np.array([3.0, -4.0], np.float32), "embed": np.array([[12.0]], np.float32)}  # global norm 13


def _first_update(clip: float):
  cfg = config.load("tiny", [*PROBE, f"optim.grad_clip={clip}"])
  opt = optim_lib.optimizer(cfg)
  params = jax.tree.map(jnp.zeros_like, G)
  updates, _ = opt.update(jax.tree.map(jnp.asarray, G), opt.init(params), params)
  return {k: np.asarray(v) for k, v in updates.items()}


def _reference(clip: float):
  norm = np.sqrt(sum(float(np.sum(np.square(x, dtype=np.float64))) for x in G.values()))  # 13
  factor = 1.0 if clip == 0 or norm < clip else clip / norm
  return {k: -0.5 * (x * factor) / (np.abs(x * factor) + 1.0) for k, x in G.items()}


@pytest.mark.parametrize("clip", [0.0, 1.3, 6.5, 13.5, 100.0])
def test_the_optimizer_clips_the_global_norm_before_adamw(clip):
  got, want = _first_update(clip), _reference(clip)
  for k in G:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=k)


def test_a_clip_changes_the_update_and_a_loose_one_does_not():
  # 1.3 = norm/10: g/10 = (0.3, -0.4, 1.2) -> -0.5*0.3/1.3 for wq[0]; unclipped: -0.5*3/4
  np.testing.assert_allclose(_first_update(1.3)["wq"][0], -0.5 * 0.3 / 1.3, rtol=1e-6)
  np.testing.assert_allclose(_first_update(0.0)["wq"][0], -0.5 * 3 / 4, rtol=1e-6)
  np.testing.assert_array_equal(_first_update(100.0)["wq"], _first_update(0.0)["wq"])


def test_clipping_leaves_the_optimizer_state_layout_as_it_was():
  """Checkpoints hold the optimizer state: with or without clipping it is AdamW's pytree."""
  params = jax.tree.map(jnp.zeros_like, G)
  on = optim_lib.optimizer(config.load("tiny", ["optim.grad_clip=1.0"])).init(params)
  off = optim_lib.optimizer(config.load("tiny", ["optim.grad_clip=0"])).init(params)
  assert jax.tree.structure(on) == jax.tree.structure(off)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(on)[0]]
  assert paths[:3] == ["[0].count", "[0].mu['embed']", "[0].mu['wq']"], paths  # what old checkpoints hold


@pytest.mark.slow
@pytest.mark.parametrize("clip_over_norm", [0.5, 10.0])
def test_the_step_clips_the_unscaled_gradient_and_logs_the_norm_before_it(clip_over_norm):
  """Whatever the loss scale, the update is the PROBE formula on the unscaled gradient clipped
  to `clip` (scaled gradients clipped, or a clip at the wrong side of the scale, would differ
  by the scale: eps=1 keeps Adam from normalizing it away)."""
  base = config.load("tiny", ["model.dtype=float32", "train.batch_size=4", "train.seq_len=32"])
  graphdef, _ = model_lib.abstract(base.model)
  params = nnx.to_pure_dict(nnx.state(model_lib.Transformer(base.model, nnx.Rngs(0))))
  it = data.batches(base)
  batch = {k: jnp.asarray(v) for k, v in next(it).items()}
  it.close()
  _, g, _ = grads_of(base, graphdef, params, batch)
  norm = float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g))))
  clip = norm * clip_over_norm
  cfg = config.load("tiny", ["model.dtype=float32", "train.batch_size=4", "train.seq_len=32", *PROBE,
                             f"optim.grad_clip={clip!r}"])
  factor = min(1.0, clip / norm)
  want = jax.tree.map(lambda p, x: np.asarray(p) - 0.5 * (np.asarray(x) * factor) / (np.abs(np.asarray(x) * factor) + 1),
                      params, g)
  setup = step.Setup(cfg, mesh_of("dp=1"))
  for scale in (1.0, 1024.0):
    state = step.init_state(cfg, setup.opt, jax.tree.map(jnp.array, params))  # a copy: the step donates it
    state["loss_scale"] = {"scale": jnp.float32(scale), "good_steps": jnp.int32(0)}
    new, metrics = setup.step(state, batch)
    assert not bool(metrics["skipped"]) and float(metrics["grad_norm"]) == pytest.approx(norm, rel=1e-5)
    for path, got in jax.tree_util.tree_flatten_with_path(new["params"])[0]:
      ref = want
      for k in path:
        ref = ref[k.key]
      np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-6 * factor * norm,
                                 err_msg=f"scale {scale} {jax.tree_util.keystr(path)}")
