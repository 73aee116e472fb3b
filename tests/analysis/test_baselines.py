"""The bench's baselines compute jaxtrain's loss and update from the same weights (float32)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.core import config
from jaxtrain.run import step
from jaxtrain.analysis import speed
from jaxtrain.analysis.baselines import minimal
from tests.helpers import mesh_of

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'

# float32 everywhere; the baselines differ from jaxtrain only in summation order (and
# optax's clip formula, norm/max(norm, c) against c/(norm+1e-6)).
LOSS_RTOL, PARAM_ATOL = 2e-5, 2e-5


def _cfg(tied):
  return config.load("tiny", ["model.dtype=float32", "train.batch_size=4", "train.seq_len=64",
                              f"model.tie_embeddings={str(tied).lower()}", "train.grad_clip=0.05"])


@functools.cache
def _jaxtrain(tied, unpacked):
  """jaxtrain's initial params, one batch, and its losses at step 0 and after one update."""
  cfg = _cfg(tied)
  setup = step.Setup(cfg, mesh_of("fsdp=1"))
  state = setup.init()
  params0 = jax.device_get(state["params"])
  batch = speed.first_batches(cfg, setup, 1, unpacked)[0]
  if not unpacked:  # two documents per row (the bundled ones are longer than a row)
    L = batch["inputs"].shape[1]
    second = np.arange(L) >= 20
    batch["segment_ids"] = (batch["segment_ids"] + second).astype(np.int32)
    batch["positions"] = np.broadcast_to(np.where(second, np.arange(L) - 20, np.arange(L)), (len(batch["inputs"]), L)).astype(np.int32)
    batch["loss_mask"][:, 19] = 0  # the last token of document 1 does not predict document 2
  dev = setup.device_batch(batch)
  state, m0 = setup.step(state, dev)
  params1 = jax.device_get(state["params"])  # before the next step donates them
  _, m1 = setup.step(state, dev)
  return params0, batch, float(m0["loss"]), float(m1["loss"]), params1


@pytest.mark.parametrize("tied, unpacked", [(False, False), (True, True)])
def test_minimal_baseline_matches_jaxtrain_loss_and_update(tied, unpacked):
  params0, batch, loss0, loss1, params1 = _jaxtrain(tied, unpacked)
  if not unpacked:
    assert (batch["segment_ids"] != batch["segment_ids"][:, :1]).any()  # segment masking is exercised
  b = minimal.Minimal(_cfg(tied))
  state = b.init(params0)
  dev = {k: jnp.asarray(v) for k, v in batch.items()}
  state, l0 = b.step(state, dev)
  np.testing.assert_allclose(float(l0), loss0, rtol=LOSS_RTOL)
  for got, want in zip(jax.tree.leaves(state[0]), jax.tree.leaves(params1)):
    np.testing.assert_allclose(got, want, atol=PARAM_ATOL)
  _, l1 = b.step(state, dev)
  np.testing.assert_allclose(float(l1), loss1, rtol=LOSS_RTOL)
  assert abs(loss1 - loss0) > 1e-3  # the update really moved the loss


@pytest.mark.parametrize("tied", [False, True])
def test_torch_baseline_matches_jaxtrain_loss_and_update(tied):
  pytest.importorskip("torch")
  from jaxtrain.analysis.baselines import torch_model
  params0, batch, loss0, loss1, _ = _jaxtrain(tied, True)
  b = torch_model.TorchBaseline(_cfg(tied), params0, compile=False)
  dev = b.to_device(batch)
  np.testing.assert_allclose(float(b.step(dev)), loss0, rtol=LOSS_RTOL)
  np.testing.assert_allclose(float(b.step(dev)), loss1, rtol=LOSS_RTOL)
  assert abs(loss1 - loss0) > 1e-3


def test_torch_baseline_refuses_packed_rows():
  pytest.importorskip("torch")
  from jaxtrain.analysis.baselines import torch_model
  params0, batch, *_ = _jaxtrain(False, False)
  with pytest.raises(ValueError, match="one document per row"):
    torch_model.TorchBaseline(_cfg(False), params0, compile=False).to_device(batch)


def test_baselines_take_scanned_parameters_layer_by_layer():
  # Presets that scan their layers (llama3-1b, tests/gpu) hand the baselines stacked parameters;
  # the baselines index layers one by one. Split, the scanned parameters give the loss of the
  # unscanned model at the same seed (float32).
  from flax import nnx
  from jaxtrain.analysis import baselines
  from jaxtrain.model import transformer as model
  rng = np.random.default_rng(0)
  tok = rng.integers(0, config.load("tiny").model.vocab_size, (2, 17), dtype=np.int32)
  batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:], "loss_mask": np.ones((2, 16), np.int32),
           "segment_ids": np.ones((2, 16), np.int32), "positions": np.tile(np.arange(16, dtype=np.int32), (2, 1))}
  losses = []
  for scan in ("false", "true"):
    cfg = config.load("tiny", [f"model.scan_layers={scan}", "model.dtype=float32"])
    params = nnx.to_pure_dict(nnx.state(model.Transformer(cfg.model, nnx.Rngs(0))))
    params = baselines.layer_list(jax.device_get(params), cfg.model.n_layers)
    assert sorted(params["layers"]) == list(range(cfg.model.n_layers))
    losses.append(float(jax.jit(lambda p, b, m=cfg.model: minimal.loss_fn(p, m, b))(params, batch)))
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
