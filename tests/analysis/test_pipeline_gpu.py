"""A pipeline compiled by XLA's GPU compiler for compile-only H100s: cuDNN attention inside the pipeline
region (its custom partitioning fails in a partially manual region; the stage plan runs it fully manual)
and the bill's arguments. Needs the CUDA plugin (the gpu-aot extra); skips without it."""

import pytest

from jaxtrain.analysis import gpu_compile, memory, report
from jaxtrain.core import config
from jaxtrain.run import step as step_lib

from tests.helpers import needs_plugin

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'


@needs_plugin
def test_zb_h1_with_cudnn_attention_compiles_for_h100s():
  cfg = config.load("tiny", ["model.n_layers=4", "model.scan_layers=true", "model.dtype=bfloat16", "train.seq_len=96",
                             "train.batch_size=8", "train.microbatches=2", "pipeline.schedule=zb-h1"])
  setup = step_lib.Setup(cfg, gpu_compile.mesh("H100", "pp=2,fsdp=2"))
  assert setup.plan.attention == "cudnn"
  c = report.compiled_memory(setup)
  assert c["backend"] == "cuda" and c["cudnn_attention"]["ops"] >= 2, c  # forward and backward
  batch = 5 * 4 * 8 * 96 // 2  # int32 inputs, targets, positions, segment ids, loss mask, split over fsdp
  assert c["arguments"] == sum(memory.state_bytes(setup).values()) + batch
  # the weights' gradients are reduce-scattered per layer, as outside a pipeline: unconstrained inside the
  # region, XLA all-reduced each layer's whole (llama3.1-70b on pp=4,fsdp=16: 702 GiB per step, 64 GiB of them kept)
  assert c["collectives"]["all-reduce"]["bytes_per_step"] < memory.state_bytes(setup)["params"], c["collectives"]
