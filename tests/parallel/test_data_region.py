"""One reduction over `data` per update (jaxtrain.parallel.data_region): the compiled step's bytes over `data` do
not grow with train.microbatches (on main they grew k-fold), the update still equals one device's on one big
batch, the MoE balance loss still sees the whole microbatch, and the analyses say what the program does."""

import functools

import numpy as np
import pytest

from jaxtrain.analysis import comms, gpu_compile, hlo_axes, memory
from jaxtrain.core import config
from jaxtrain.run import step
from tests.helpers import mesh_of, needs_plugin, trajectory

BASE = ["model.dtype=float32", "train.batch_size=16", "train.seq_len=32"]
slow = pytest.mark.slow
MESHES = [("dp=4", []), ("dp=2,fsdp=2", ["optim.zero_stage=1"]),  # the rest: compiles left out of -m 'not slow'
          pytest.param("dp=2,fsdp=2", [], marks=slow), pytest.param("dp=4", ["optim.zero_stage=1"], marks=slow),
          pytest.param("pipeline=2,dp=2", [], marks=slow), pytest.param("dp=2,fsdp=2,tp=2", [], marks=slow),
          pytest.param("dp=2,tp=2,ep=2", ["model.moe_experts=4"], marks=slow)]


def _data_bytes(spec: str, k: int, sets, mesh=None) -> int:
  cfg = config.load("tiny", BASE + [f"train.microbatches={k}", *sets])
  setup = step.Setup(cfg, mesh if mesh is not None else mesh_of(spec))
  compiled, _ = gpu_compile.compile_step(setup)
  by_axes = hlo_axes.bytes_by_axes(gpu_compile.Hlo.parse(compiled.as_text()), dict(setup.mesh.shape))
  return hlo_axes.over(by_axes, "data")


@pytest.mark.parametrize("spec, sets", MESHES)
def test_bytes_over_data_do_not_grow_with_microbatches(spec, sets):
  first = 2 if spec.startswith("pipeline") else 1  # every stage needs a microbatch
  one, four = _data_bytes(spec, first, sets), _data_bytes(spec, 4, sets)
  assert one > 0  # the gradients are reduced over data at all
  assert four <= 1.02 * one, f"{spec} {sets}: {one} bytes over data at {first} microbatch(es), {four} at 4"


@pytest.mark.slow
def test_zero2_keeps_its_gradients_split_and_reduce_scatters_each_microbatch():
  """The decision (data_region.wanted): ZeRO-2 is for gradients split over data, which an unreduced accumulator is
  not; its reduce-scatters stay per microbatch, as the bill says."""
  sets = ["optim.zero_stage=2"]
  one, four = _data_bytes("dp=2,fsdp=2", 1, sets), _data_bytes("dp=2,fsdp=2", 4, sets)
  assert four > 2 * one


@pytest.mark.slow
@needs_plugin
def test_bytes_over_data_do_not_grow_with_microbatches_on_h100s():
  one, four = (_data_bytes("", k, ["model.dtype=bfloat16"], gpu_compile.mesh("H100", "dp=4")) for k in (1, 4))
  assert one > 0 and abs(four - one) <= 0.02 * one, (one, four)


@functools.cache
def _run(spec: str, *sets: str):
  return trajectory(config.load("tiny", BASE + list(sets)), spec, 2)


@pytest.mark.slow
@pytest.mark.parametrize("spec, sets", [("dp=4", ()), ("dp=2,fsdp=2", ()), ("dp=4", ("optim.zero_stage=2",)),
                                        ("pipeline=2,dp=2", ())])
def test_four_microbatches_equal_one_device_one_batch(spec, sets):
  got, ref = _run(spec, "train.microbatches=4", *sets), _run("dp=1", "train.microbatches=1")
  assert got[-1, 0] < got[0, 0]  # it trains
  np.testing.assert_allclose(got, ref, rtol=2e-5, err_msg=f"(loss, grad_norm) at 4 microbatches on {spec} {sets}")


@pytest.mark.slow
def test_balance_loss_sees_the_whole_microbatch():
  """Each device holds half the rows; the balance loss multiplies two means over the whole microbatch. Local means
  would change it (and the gradient) while the token loss stayed the same."""
  sets = ("model.moe_aux_weight=0.1", "model.moe_z_weight=0.01", "train.microbatches=2")
  got = trajectory(config.load("moe-tiny", BASE + list(sets)), "dp=2", 2)
  ref = trajectory(config.load("moe-tiny", BASE + list(sets)), "dp=1", 2)
  np.testing.assert_allclose(got, ref, rtol=2e-5)


def test_comms_and_memory_count_one_reduction_over_data():
  def billed(k):
    cfg = config.load("tiny", BASE + [f"train.microbatches={k}"])
    setup = step.Setup(cfg, mesh_of("dp=4"))
    rows = memory.grouped(memory.param_rows(setup))
    return comms.traffic(setup.cfg, setup.mesh, rows)["data"], setup
  (one, _), (four, setup) = billed(1), billed(4)
  assert one == four and sum(one.values()) > 0
  bill = memory.bill(setup, memory.grouped(memory.param_rows(setup)), 0.0)
  assert bill.items["grad_accumulator"] == memory.step_bytes(setup)["gradients"] > 0  # dp: sharded like the params
  assert "reduced over data once" in bill.notes["grad_accumulator"]
