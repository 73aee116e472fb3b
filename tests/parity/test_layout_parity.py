"""Loss parity for the shard_map parallelisms (ring attention, ...) against one device."""

import numpy as np
import pytest

from jaxtrain.core import config
from tests.helpers import trajectory
from tests.parity.test_one_device_parity import STEPS, reference  # noqa: F401  (module fixture: the dense one-device run)

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'


def _trajectory(spec: str, cfg=None):
  """(loss, grad_norm) per step on mesh `spec`; cfg defaults to test_parity's dense config."""
  from tests.parity.test_one_device_parity import CFG
  return trajectory(cfg or CFG, spec, STEPS)


@pytest.mark.parametrize("spec", ["sp=4", "dp=2,sp=2,tp=2"])
def test_ring_attention_matches_single_device(spec, reference):  # noqa: F811
  got = _trajectory(spec)
  assert got[-1, 0] < got[0, 0]
  np.testing.assert_allclose(got[:, 0], reference[:, 0], rtol=1e-5, err_msg=f"loss on {spec}")
  np.testing.assert_allclose(got[:, 1], reference[:, 1], rtol=1e-5, err_msg=f"grad_norm on {spec}")


MOE_CFG = config.load("moe-tiny", ["model.dtype=float32", "train.microbatches=2", "model.moe_capacity_factor=0"])


@pytest.fixture(scope="module")
def moe_reference():
  return _trajectory("dp=1", MOE_CFG)


@pytest.mark.parametrize("spec", ["ep=4", "ep=2,fsdp=2,tp=2"])
def test_expert_parallel_moe_matches_single_device(spec, moe_reference):
  got = _trajectory(spec, MOE_CFG)
  assert got[-1, 0] < got[0, 0]
  np.testing.assert_allclose(got[:, 0], moe_reference[:, 0], rtol=1e-5, err_msg=f"loss on {spec}")
  np.testing.assert_allclose(got[:, 1], moe_reference[:, 1], rtol=1e-5, err_msg=f"grad_norm on {spec}")


def test_tensor_parallel_with_sequence_parallelism_matches_single_device(reference):  # noqa: F811
  from tests.parity.test_one_device_parity import CFG
  cfg = config.load("tiny", ["model.dtype=float32", "train.microbatches=2", "train.sequence_parallel=true"])
  assert cfg.model == CFG.model and cfg.train.microbatches == CFG.train.microbatches
  got = _trajectory("tp=4", cfg)
  np.testing.assert_allclose(got[:, 0], reference[:, 0], rtol=1e-5, err_msg="loss on tp=4 + SP")
  np.testing.assert_allclose(got[:, 1], reference[:, 1], rtol=1e-5, err_msg="grad_norm on tp=4 + SP")
