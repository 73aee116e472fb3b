"""The compiled program's efficiency fields (jaxtrain.analysis.costs): finite, and remat
shows as recomputed FLOPs."""

import numpy as np

from jaxtrain.analysis import costs, gpu_compile
from jaxtrain.analysis import memory
from jaxtrain.core import config
from jaxtrain.model import flops
from jaxtrain.run import step
from tests.helpers import mesh_of


SMALL = ["model.dtype=float32", "train.batch_size=4", "train.seq_len=32", "model.n_layers=2"]


def _efficiency(*sets):
  cfg = config.load("tiny", [*SMALL, *sets])
  setup = step.Setup(cfg, mesh_of("dp=1"))
  compiled = setup.step.lower(*gpu_compile.abstract_inputs(setup)).compile()
  model = flops.flops_per_token(cfg.model, 32) * 4 * 32
  return costs.efficiency(compiled, model, sum(memory.state_bytes(setup).values()))


def test_efficiency_fields_are_finite_and_remat_shows_as_recompute():
  none, full = _efficiency("model.remat=none"), _efficiency("model.remat=full")
  for e in (none, full):
    for k in ("compiled_flops_per_device", "compiled_over_model_flops", "bytes_accessed_per_device",
              "bytes_accessed_over_state"):
      assert np.isfinite(e[k]) and e[k] > 0, k
  # The program does at least the model's matmuls; full remat recomputes each block's forward.
  assert 0.9 < none["compiled_over_model_flops"] < full["compiled_over_model_flops"]
  assert full["compiled_over_model_flops"] > none["compiled_over_model_flops"] * 1.15
