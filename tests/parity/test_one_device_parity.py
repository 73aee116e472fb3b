"""Sharded runs against the single-device run: loss and grad_norm at every step."""

import numpy as np
import pytest

from jaxtrain.core import config
from jaxtrain.run import step
from tests.helpers import mesh_of, trajectory

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'

STEPS = 3
CFG = config.load("tiny", ["model.dtype=float32", "train.microbatches=2"])


def _trajectory(spec: str):
  return trajectory(CFG, spec, STEPS)


@pytest.fixture(scope="module")
def reference():
  return _trajectory("dp=1")


@pytest.mark.parametrize("spec", ["dp=4", "fsdp=4", "tp=4", "dp=2,tp=2", "fsdp=2,tp=2", "sp=2,dp=2"])
def test_sharded_matches_single_device(spec, reference):
  got = _trajectory(spec)
  assert got[-1, 0] < got[0, 0]  # it trains
  np.testing.assert_allclose(got[:, 0], reference[:, 0], rtol=1e-5, err_msg=f"loss on {spec}")
  np.testing.assert_allclose(got[:, 1], reference[:, 1], rtol=1e-5, err_msg=f"grad_norm on {spec}")


def test_params_are_really_sharded():
  setup = step.Setup(CFG, mesh_of("fsdp=2,tp=2"))
  state = setup.init()
  wq = state["params"]["layers"][0]["attn"]["wq"]  # (embed, heads, head_dim) -> (fsdp, tensor, -)
  assert wq.sharding.spec[:2] == ("fsdp", "tensor")
  assert wq.addressable_shards[0].data.shape == (64, 4, 16)
  mu = state["opt"][0].mu["layers"][0]["attn"]["wq"]  # Adam moments sharded like their params
  assert mu.sharding == wq.sharding
