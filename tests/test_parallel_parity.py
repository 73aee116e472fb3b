"""Loss parity for the shard_map parallelisms (ring attention, ...) against one device."""

import pytest

from tests.test_parity import _trajectory, reference  # noqa: F401  (module fixture)
import numpy as np


@pytest.mark.parametrize("spec", ["sp=4", "dp=2,sp=2,tp=2"])
def test_ring_attention_matches_single_device(spec, reference):  # noqa: F811
  got = _trajectory(spec)
  assert got[-1, 0] < got[0, 0]
  np.testing.assert_allclose(got[:, 0], reference[:, 0], rtol=1e-5, err_msg=f"loss on {spec}")
  np.testing.assert_allclose(got[:, 1], reference[:, 1], rtol=1e-5, err_msg=f"grad_norm on {spec}")
