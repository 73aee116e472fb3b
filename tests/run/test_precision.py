"""Mixed precision: dynamic loss scaling, skipped steps, and the two token clocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import data
from jaxtrain.core import config
from jaxtrain.run import metrics
from jaxtrain.model import transformer as model_lib
from jaxtrain.run import precision
from jaxtrain.run import progress
from jaxtrain.run import optimizer as optim_lib, step
from tests.helpers import grads_of, mesh_of

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'


def _batches(cfg, n):
  it = data.batches(cfg)
  out = [next(it) for _ in range(n)]
  it.close()
  return out


def _poison(batch):
  """Same tokens, but one loss weight is inf: that step's gradients are not finite."""
  mask = batch["loss_mask"].astype(np.float32)
  mask[0, 0] = np.inf
  return {**batch, "loss_mask": mask}


def _leaves_equal(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_injected_inf_skips_the_step_and_changes_nothing(dtype, tmp_path):
  cfg = config.load("tiny", [f"model.dtype={dtype}", "loss_scale.growth_interval=100"])
  setup = step.Setup(cfg, mesh_of("dp=2"))
  run_state = progress.Progress()

  def log(s, device_metrics):
    fetched = jax.device_get(device_metrics)
    run_state.count(s, int(fetched["tokens"]), bool(fetched["skipped"]))
    return metrics.record(s, fetched, 1.0, 0.0, run_state, 1.0, None)

  good1, good2 = _batches(cfg, 2)
  state, m1 = setup.step(setup.init(), setup.device_batch(good1))
  r1 = log(1, m1)
  before = jax.device_get(state)
  state, m2 = setup.step(state, setup.device_batch(_poison(good1)))
  r2 = log(2, m2)
  after = jax.device_get(state)
  assert r2["skipped"] and not r1["skipped"]
  assert _leaves_equal(after["params"], before["params"]) and _leaves_equal(after["opt"], before["opt"])
  assert after["step"] == before["step"] == 1 and r2["lr"] == float(optim_lib.lr_schedule(cfg.optim, cfg.train.steps)(1))
  assert r2["tokens_seen"] == r1["tokens"] + r2["tokens"] and r2["tokens_updated"] == r1["tokens"]
  if dtype == "float16":
    assert after["loss_scale"]["scale"] == before["loss_scale"]["scale"] / 2
  else:
    assert after["loss_scale"]["scale"] == 1.0
  # The next good step proceeds as if the bad batch had never come.
  state, m3 = setup.step(state, setup.device_batch(good2))
  r3 = log(3, m3)
  assert not r3["skipped"] and r3["tokens_updated"] == r1["tokens"] + r3["tokens"]
  if dtype == "float32":
    ref, _ = setup.step(setup.step(setup.init(), setup.device_batch(good1))[0], setup.device_batch(good2))
    assert _leaves_equal(jax.device_get(state["params"]), jax.device_get(ref["params"]))


def test_scale_grows_after_the_interval_and_respects_its_bounds():
  cfg = config.load("tiny", ["model.dtype=float16", "loss_scale.initial=1024", "loss_scale.growth_interval=3",
                             "loss_scale.max=4096", "loss_scale.min=256"])
  s = precision.init(cfg)
  seen = []
  for finite in [True] * 10:
    s = precision.update(cfg, s, jnp.bool_(finite))
    seen.append(float(s["scale"]))
  assert seen == [1024, 1024, 2048, 2048, 2048, 4096, 4096, 4096, 4096, 4096]
  for _ in range(5):
    s = precision.update(cfg, s, jnp.bool_(False))
  assert float(s["scale"]) == 256 and int(s["good_steps"]) == 0
  off = config.load("tiny", ["model.dtype=bfloat16"])
  assert float(precision.update(off, precision.init(off), jnp.bool_(False))["scale"]) == 1.0


def test_scale_grows_inside_the_jitted_step():
  cfg = config.load("tiny", ["model.dtype=float16", "loss_scale.initial=1024", "loss_scale.growth_interval=2"])
  setup = step.Setup(cfg, mesh_of("dp=1"))
  state, scales = setup.init(), []
  for b in _batches(cfg, 5):
    state, m = setup.step(state, setup.device_batch(b))
    scales.append(float(m["loss_scale"]))
  assert scales == [1024, 1024, 2048, 2048, 4096]


def _trajectory(overrides, n=4):
  cfg = config.load("tiny", overrides)
  setup = step.Setup(cfg, mesh_of("dp=1"))
  state, losses = setup.init(), []
  for b in _batches(cfg, n):
    state, m = setup.step(state, setup.device_batch(b))
    assert not bool(m["skipped"])
    losses.append(float(m["loss"]))
  return np.array(losses)


def test_float16_with_loss_scaling_tracks_float32():
  fp32 = _trajectory(["model.dtype=float32"])
  fp16 = _trajectory(["model.dtype=float16"])
  np.testing.assert_allclose(fp16, fp32, rtol=2e-3)  # stated tolerance: 0.2% over 4 steps


def _wq_grad(dtype, mode):
  cfg = config.load("tiny", [f"model.dtype={dtype}", "model.init_std=1e-3", f"loss_scale.mode={mode}"])
  graphdef, _ = model_lib.abstract(cfg.model)
  params = nnx.to_pure_dict(nnx.state(model_lib.Transformer(cfg.model, nnx.Rngs(0))))
  batch = {k: jnp.asarray(v) for k, v in _batches(cfg, 1)[0].items()}
  scale = precision.init(cfg)["scale"]
  _, g, _ = jax.jit(lambda p, b, s: grads_of(cfg, graphdef, p, b, loss_scale=s))(params, batch, scale)
  return np.asarray(g["layers"][0]["attn"]["wq"])


def test_loss_scaling_rescues_gradients_that_underflow_in_float16():
  ref = _wq_grad("float32", "off")
  unscaled = _wq_grad("float16", "off")
  scaled = _wq_grad("float16", "auto")
  assert np.count_nonzero(ref) == ref.size
  assert np.count_nonzero(unscaled) == 0  # every element flushed to zero
  assert np.linalg.norm(scaled - ref) / np.linalg.norm(ref) < 0.1


def test_abort_after_n_skipped_steps_in_a_row(run_cli):
  # A learning rate of 1e30 blows the params up at step 1; every later step is non-finite.
  r = run_cli("jaxtrain.train", "--steps", "12", "--workdir", "w", "--set", "model.dtype=float32",
              "--set", "train.lr=1e30", "--set", "train.max_skipped_in_a_row=3")
  assert r.returncode == 1
  assert r.stderr.strip().splitlines()[-1] == (
      "jaxtrain: error: aborting at step 4: 3 steps in a row (steps 2-4) had non-finite gradients or no valid "
      "token (train.max_skipped_in_a_row=3); loss scale 1")


def test_loss_scale_and_clocks_are_part_of_the_run_state(tmp_path):
  """Until checkpoints land: the device state carries the loss scale and the schedule
  position, and the host log carries both token clocks, for the checkpoint to save."""
  cfg = config.load("tiny", ["model.dtype=float16"])
  setup = step.Setup(cfg, mesh_of("dp=1"))
  state = setup.init()
  assert set(state) == {"params", "opt", "step", "loss_scale"}
  assert setup.state_shardings["loss_scale"].keys() == state["loss_scale"].keys()
  assert float(state["loss_scale"]["scale"]) == cfg.loss_scale.initial
  run_state = progress.Progress()
  assert (run_state.tokens_seen, run_state.tokens_updated) == (0, 0)
