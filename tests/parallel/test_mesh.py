import pytest

from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.core.errors import UserError


def test_parse_aliases_and_defaults():
  assert mesh_lib.parse("dp=8,tp=8") == {"pipeline": 1, "data": 8, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 8}
  assert mesh_lib.parse("fsdp=2, sequence=2,ep=2")["expert"] == 2


def test_fill_resolves_minus_one():
  assert mesh_lib.fill(mesh_lib.parse("dp=-1,tp=2"), 8)["data"] == 4


def test_preset_by_name():
  assert mesh_lib.parse("headline") == mesh_lib.parse("dp=8,tp=8")


@pytest.mark.parametrize("spec, words", [
    ("xp=2", ["unknown mesh axis 'xp'", "data (dp)", "tensor (tp)"]),
    ("dp=0", ["dp=0", "positive integer"]),
    ("dp=two", ["dp=two", "positive integer"]),
    ("dp=2,data=2", ["given twice"]),
    ("dp=-1,tp=-1", ["more than one -1"]),
    ("nosuchpreset", ["presets:", "headline"]),
])
def test_bad_specs_name_the_problem(spec, words):
  with pytest.raises(UserError) as e:
    mesh_lib.parse(spec)
  for w in words:
    assert w in str(e.value)


def test_product_must_match_device_count():
  with pytest.raises(UserError, match="needs 16 devices but 8 are available"):
    mesh_lib.fill(mesh_lib.parse("dp=4,tp=4"), 8)
  with pytest.raises(UserError, match="does not divide the 8 devices"):
    mesh_lib.fill(mesh_lib.parse("dp=-1,tp=3"), 8)


def test_build_orders_tensor_innermost():
  import jax
  mesh = mesh_lib.build(mesh_lib.parse("dp=2,tp=4"), jax.devices()[:8])
  assert mesh.axis_names == mesh_lib.AXES and mesh.axis_names[-1] == "tensor"
  # Neighbouring device ids share a tensor group (fast links are innermost).
  assert [d.id for d in mesh.devices.reshape(2, 4)[0]] == [0, 1, 2, 3]


def test_hybrid_mesh_parsing_and_its_errors():
  sizes, dcn = mesh_lib.parse_full("pod-4x8")
  assert sizes["data"] == 4 and sizes["fsdp"] == 8 and dcn["data"] == 4 and dcn["fsdp"] == 1
  assert mesh_lib.parse_full("dp=4,tp=2,dcn.dp=2")[1]["data"] == 2
  with pytest.raises(UserError, match="dcn.data=3 must divide data=4"):
    mesh_lib.parse_full("dp=4,dcn.dp=3")
  import jax
  sizes, dcn = mesh_lib.parse_full("dp=4,dcn.dp=2")
  with pytest.raises(UserError, match="dcn factors multiply to 2 but the run has 1 host"):
    mesh_lib.build(sizes, jax.devices()[:4], dcn=dcn)


@pytest.mark.parametrize("args, words", [
    (("127.0.0.1:1234", 2, None), "missing --process-id"),
    (("localhost", 2, 0), "must look like HOST:PORT"),
    (("127.0.0.1:1234", 2, 2), "--process-id 2 must lie in [0, --num-processes=2)"),
])
def test_distributed_flags_are_checked(args, words):
  from jaxtrain.parallel import distributed
  with pytest.raises(UserError) as e:
    distributed.cluster_from(*args)
  assert words in str(e.value)


def test_simulated_devices_are_asked_for_even_with_a_gpu_plugin_installed(monkeypatch):
  """The gpu-aot extra installs the CUDA plugin: on a machine without a GPU JAX falls back to the CPU, which must
  then still have the mesh's devices (on a GPU machine the CPU count is unused)."""
  import jax

  from jaxtrain.parallel import mesh as mesh_lib
  asked = {}
  monkeypatch.setattr(mesh_lib, "has_accelerator_plugin", lambda: True)
  monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.setattr(jax.config, "update", lambda name, value: asked.__setitem__(name, value))
  mesh_lib.provide_cpu_devices(64)
  assert asked == {"jax_num_cpu_devices": 64}


def test_a_collective_failed_by_a_lost_peer_waits_for_the_runtimes_verdict(monkeypatch):
  """A multi-process run whose collective fails because a peer died (gloo's error names no process) waits for the
  runtime's heartbeat verdict, which names the process; any other aborted run reports at once."""
  from jaxtrain.core.errors import RunAborted
  from jaxtrain.parallel import distributed
  slept = []
  monkeypatch.setattr(distributed.time, "sleep", slept.append)
  monkeypatch.setattr(distributed, "_heartbeat_s", [5])
  try:
    raise RuntimeError("UNKNOWN: Gloo AllGather failed: Connection closed by peer")
  except RuntimeError as e:
    lost = RunAborted("checkpoint save at step 2 failed")
    lost.__context__ = e
  distributed.await_lost_peer_verdict(lost)
  distributed.await_lost_peer_verdict(RunAborted("checkpoint save at step 2 failed: disk full"))
  assert slept == [7]  # the heartbeat timeout (5 s) and 2 s: the verdict comes within one timeout
  monkeypatch.setattr(distributed, "_heartbeat_s", [0])  # one process: nothing to wait for
  distributed.await_lost_peer_verdict(lost)
  assert slept == [7]  # the heartbeat timeout (5 s) and 2 s: the verdict comes within one timeout
