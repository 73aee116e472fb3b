"""ZeRO stages and offload on XLA:GPU's compile for H100s (no GPU needed; the gpu-aot extra): llama3.1-8b,
32 scanned layers, seq 4096, full remat."""

import pytest

from jaxtrain.analysis import gpu_compile, report
from jaxtrain.core import config

from tests.helpers import needs_plugin

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'

SHAPE = ["train.seq_len=4096", "model.remat=full"]


def _report(spec, sets, compile=True):
  return report.report(config.load("llama3.1-8b", SHAPE + sets), gpu_compile.mesh("H100", spec), "llama3.1-8b",
                       compile=compile, device_memory="H100")


@needs_plugin
def test_llama31_8b_on_one_h100_does_not_fit_and_offload_moves_master_and_moments_to_the_host():
  alone = _report("dp=1", ["train.batch_size=1"])
  assert alone["compiled"]["total"] > 80 * 2**30 and alone["memory"]["fits"] is False
  # not compiled: XLA:GPU without a GPU cannot place host memory (its abstract devices have no memory kinds)
  off = _report("dp=1", ["train.batch_size=1", "optim.offload=host"], compile=False)
  assert off["memory"]["host_per_host"] == 12 * off["param_count"]  # master + m + v, float32
  i = off["memory"]["items"]
  assert i["master"] == i["adam_m"] == i["adam_v"] == 0 and i["params"] < alone["memory"]["items"]["params"]
  assert off["memory"]["fits"] is True  # by the bill: the update holds one unit (the embedding) at a time


@needs_plugin
def test_llama31_8b_on_8_h100s_compiled_memory_falls_with_the_zero_stage():
  reps = [_report("dp=8", ["train.batch_size=8", f"optim.zero_stage={s}"]) for s in (0, 1, 2)]
  totals = [r["compiled"]["total"] for r in reps]
  assert totals[0] > totals[1] > totals[2], totals
  for r in reps:
    assert r["compiled"]["arguments"] == r["compiled"]["analytic"]["arguments"]  # the stored state, as billed
  # the stored state falls from stage 0 to 1 by the master and moments split 8 ways: 12 bytes x 7/8 per parameter.
  # (The totals fell by as much while stage 0's update held a second copy of the state: 159.6 -> 72.1 GB; the
  # one-pass update holds none, 128.5 -> 72.1 GB, stage 1's temporaries being the gradients and compute copy.)
  saved = reps[0]["compiled"]["arguments"] - reps[1]["compiled"]["arguments"]
  assert 0.85 <= saved / (12 * reps[0]["param_count"] * 7 / 8) <= 1.15, saved
