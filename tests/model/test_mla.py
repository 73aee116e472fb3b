"""YaRN's frequencies and magnitude factors against `transformers`' own (the MLA layer itself is checked against
transformers' DeepseekV3 in tests/interop/test_deepseek.py)."""

import dataclasses

import numpy as np
import pytest

from jaxtrain.core import config
from jaxtrain.model import rope

pytest.importorskip("transformers")


@pytest.mark.parametrize("mscale,mscale_all_dim", [(1.0, 1.0), (0.707, 0.5), (0.0, 0.0)])
def test_yarn_matches_transformers(mscale, mscale_all_dim):
  import transformers
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_get_mscale
  params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1}
  if mscale:
    params.update(mscale=mscale, mscale_all_dim=mscale_all_dim)
  hc = transformers.DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters=params)
  want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hc, "cpu")
  m = dataclasses.replace(config.load("deepseek-v3").model, rope_mscale=mscale, rope_mscale_all_dim=mscale_all_dim)
  np.testing.assert_allclose(rope.inv_freq(m), want.numpy(), rtol=1e-6)  # pow differs by an ulp
  assert rope.table_scale(m) == pytest.approx(want_factor, rel=1e-12)
  softmax = yarn_get_mscale(40.0, mscale_all_dim) ** 2 if mscale_all_dim else 1.0  # as DeepseekV3Attention.scaling
  assert rope.softmax_scale(m) == pytest.approx(softmax, rel=1e-12)
