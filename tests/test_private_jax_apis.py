"""Each private jax/orbax API jaxtrain relies on is probed, and where it is missing (simulated here by removing
it) the command goes on by a documented slower or narrower path with a one-line note, never a traceback."""

import hashlib

import pytest

from jaxtrain.core import config


def test_cluster_detection_missing_means_explicit_flags_only(monkeypatch, capsys):
  from jax._src import clusters
  from jaxtrain.parallel import distributed
  monkeypatch.delattr(clusters.ClusterEnv, "_cluster_types")
  assert distributed.cluster_from(None, None, None) is None
  assert distributed.cluster_from("h:1", 2, 1) == distributed.Cluster("h:1", 2, 1)
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 1 and err[0].startswith("note: cannot read JAX's cluster detection"), err


@pytest.fixture
def fresh_client_probe():
  from jaxtrain.run import filecheck
  filecheck._client.cache_clear()
  yield filecheck
  filecheck._client.cache_clear()


def test_without_the_key_value_client_process_0_hashes_every_file(tmp_path, monkeypatch, capsys, fresh_client_probe):
  filecheck = fresh_client_probe
  from jax._src import distributed
  monkeypatch.delattr(distributed, "global_state")
  listing = {}
  for i in range(3):
    (tmp_path / f"f{i}").write_bytes(bytes(range(i, 200)))
    listing[f"f{i}"] = 200 - i
  monkeypatch.setattr(filecheck, "processes", lambda: (2, 1))
  assert filecheck.hash_to_first(tmp_path, "k") is None  # returns at once: nothing to wait for
  monkeypatch.setattr(filecheck, "processes", lambda: (2, 0))
  got = filecheck.hash_to_first(tmp_path, "k", listing)
  assert got == {n: hashlib.sha256((tmp_path / n).read_bytes()).hexdigest() for n in listing}
  filecheck.cancel("k", "why")  # nothing to tell: no client
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 1 and "process 0 hashes every checkpoint file itself" in err[0], err


def test_without_the_packed_cudnn_module_the_plan_takes_the_mask_path(monkeypatch):
  """Probed, with a fall-back said on the plan line: packed rows go as an L x L mask without the private module;
  one-document rows keep the causal path (the public jax.nn.dot_product_attention)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  from jaxtrain.parallel import devices, kernels as attention
  m = config.load("tiny", ["model.dtype=bfloat16", "model.attention_max_segments=8"]).model
  h100 = devices.of("H100")
  attention.packed_module.cache_clear()
  try:
    assert attention.select(m, 64, h100, 5)[2] == 5  # the independent reference: with the module, packed is chosen
    monkeypatch.delattr(fa, "dot_product_attention")
    attention.packed_module.cache_clear()
    kernel, why, slots = attention.select(m, 64, h100, 5)
    assert kernel == "cudnn" and slots == 0
    assert "segments as an L x L mask: the packed layout needs jax's private cuDNN module" in why, why
    assert attention.select(m, 64, h100, 1)[1:] == ("cuDNN fused attention (causal; one document per row: causal "
                                                    "alone, no mask)", 1)
  finally:
    attention.packed_module.cache_clear()


def test_without_the_cudnn_backward_primitive_the_ring_keeps_its_xla_blocks(monkeypatch):
  """Ring attention's cuDNN pairs bind the private backward primitive: probed; without it the plan line says the
  ring folds XLA blocks and why."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  from jaxtrain.parallel import devices, kernels, ring
  m, h100 = config.load("tiny", ["model.dtype=bfloat16"]).model, devices.of("H100")
  kernels.block_module.cache_clear()
  try:
    assert ring.pair_problem(m, 64, h100) is None  # the reference: with the primitive, cuDNN pairs
    monkeypatch.delattr(fa, "_dot_product_attention_bwd_p_wrapper")
    kernels.block_module.cache_clear()
    why = ring.pair_words(ring.pair_problem(m, 64, h100), 1)
    assert why == "online softmax over XLA blocks, not cuDNN: jax's private cuDNN module lacks what the pairs use"
  finally:
    kernels.block_module.cache_clear()


def test_without_the_capability_check_tracing_is_not_redirected(monkeypatch, capsys):
  from jax._src.cudnn import fused_attention_stablehlo as fa
  from jaxtrain.analysis import gpu_compile
  monkeypatch.delattr(fa, "check_compute_capability")
  with gpu_compile._capability_of("H100"):
    assert not hasattr(fa, "check_compute_capability")  # nothing patched in
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 1 and err[0].startswith("note: cannot point jax's cuDNN capability check"), err


def test_without_orbax_handler_registration_checkpoints_use_the_default(monkeypatch, capsys, tmp_path):
  import jax.numpy as jnp
  import numpy as np
  import orbax.checkpoint as ocp
  from jaxtrain.run import checkpoint
  monkeypatch.delattr(ocp.type_handlers, "register_type_handler")
  checkpoint._write_each_shard_once.cache_clear()
  try:
    checkpoint._write_each_shard_once()
  finally:
    checkpoint._write_each_shard_once.cache_clear()
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 1 and err[0].startswith("note: orbax's array handler could not be set"), err
  state = {"w": jnp.arange(6.0).reshape(2, 3)}
  with ocp.StandardCheckpointer() as ck:
    ck.save(tmp_path / "s", state)
  with ocp.StandardCheckpointer() as ck:
    np.testing.assert_array_equal(ck.restore(tmp_path / "s", state)["w"], state["w"])


def test_without_the_dot_lowering_bfloat16_matmuls_keep_xlas_kernel(monkeypatch, capsys):
  import jax
  import jax.numpy as jnp
  from jax._src.lax import lax
  from jaxtrain.core import cpu_dots
  monkeypatch.delattr(lax, "_dot_general_lower")
  cpu_dots.install.cache_clear()
  try:
    assert cpu_dots.install() is False
    x = jnp.ones((4, 8), jnp.bfloat16)
    assert float(jax.jit(lambda a: (a @ a.T).sum())(x)) == 128.0  # bfloat16 matmuls still run
  finally:
    cpu_dots.install.cache_clear()
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 1 and err[0].startswith("note: cannot reach jax's dot_general lowering"), err
