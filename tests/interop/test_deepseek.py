"""DeepSeek-V3 against `transformers` (a tiny DeepseekV3Config model built locally): logits after import and after
export, the bit-identical round trip, greedy generation with the latent cache, the same training run on tensor,
sequence and expert meshes, and the 671B preset's exact parameter count."""

import dataclasses

import numpy as np
import pytest

pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from jaxtrain import data  # noqa: E402
from jaxtrain.core import config  # noqa: E402
from jaxtrain.interop import decode, hf_export  # noqa: E402
from jaxtrain.model import transformer as model_lib  # noqa: E402
from jaxtrain.run import checkpoint, runs, step  # noqa: E402
from tests import hf_models as H  # noqa: E402
from tests.helpers import mesh_of  # noqa: E402
from tests.interop.test_generate import PROMPTS, _full_forward_greedy  # noqa: E402
from tests.interop.test_hf import _bit_identical, _tensors  # noqa: E402

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'

IDS = np.random.default_rng(0).integers(0, 96, (2, 24))  # 24 positions: 3x YaRN's original context (8)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
  d = tmp_path_factory.mktemp("deepseek")
  ref = H.deepseek_v3(d / "hf")
  H.imported(d / "hf", d / "w", extra=["model.scan_layers=true"])  # two stacks: the dense first layer, then MoE
  return d, ref, H.load(d / "w")


def test_logits_match_transformers_after_import(deepseek, tmp_path):
  d, ref, (cfg, model, _) = deepseek
  m = cfg.model
  assert (m.attention_type, m.q_lora_rank, m.rope_scaling, m.moe_n_group, m.moe_topk_group, m.moe_first_dense,
          m.moe_routed_scale, m.scan_layers) == ("mla", 24, "yarn", 4, 2, 1, 2.5, True)
  assert H.rel_err(H.jax_logits(model, IDS), H.torch_logits(ref, IDS)) < 1e-5
  # without the low-rank query (q_lora_rank null: one q_proj), on a tensor x fsdp mesh
  ref2 = H.deepseek_v3(tmp_path / "hf", seed=1, q_lora_rank=None)
  H.imported(tmp_path / "hf", tmp_path / "w", "fsdp=2,tp=2")
  cfg2, model2, _ = H.load(tmp_path / "w", "fsdp=2,tp=2")
  assert cfg2.model.q_lora_rank == 0
  assert H.rel_err(H.jax_logits(model2, IDS), H.torch_logits(ref2, IDS)) < 1e-5


def test_export_is_bit_identical_and_the_same_function_in_transformers(deepseek, tmp_path):
  import torch
  import transformers
  d, ref, (cfg, model, _) = deepseek
  step_dir = runs.locate(d / "w", 0)
  hf_export.run_export(runs.config_of(checkpoint.read_manifest(step_dir)), mesh_of("fsdp=1"), step_dir, tmp_path / "out",
                "float32", 10**9, d / "w")
  _bit_identical(_tensors(d / "hf"), _tensors(tmp_path / "out"))
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
  assert type(back).__name__ == "DeepseekV3ForCausalLM"
  assert H.rel_err(H.jax_logits(model, IDS), H.torch_logits(back, IDS)) < 1e-5


def test_greedy_generation_with_the_latent_cache(deepseek):
  """20 greedy tokens equal transformers.generate and recomputing the whole sequence per token; the cache holds the
  latent and the RoPE key (kv_lora_rank + qk_rope_head_dim values per token and layer), not per-head K/V."""
  d, ref, (cfg, model, params) = deepseek
  ours = decode.generate(cfg, mesh_of("fsdp=1"), nnx.split(model)[0], params, PROMPTS, 20)
  assert ours == H.transformers_greedy(ref, PROMPTS, 20)
  assert ours == _full_forward_greedy(model, PROMPTS, 20)
  m = cfg.model
  assert decode.cache_bytes_per_token(cfg) == m.n_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 4


def test_mla_and_group_routing_train_alike_on_tensor_sequence_and_expert_meshes():
  """3 steps of deepseek-v3-tiny (narrowed to a dense and a MoE layer, float32) on one device and on tp=2,sp=2,ep=2
  (heads split, ring attention with the decoupled RoPE key and v narrower than q/k, experts over all_to_all with
  group-limited routing), the latter with scan_layers (two stacks; the routing bias moved on the MoE stack)."""
  sets = ["model.dtype=float32", "train.batch_size=8", "train.seq_len=16", "model.d_model=32", "model.d_ff=64",
          "model.moe_expert_d_ff=16", "model.n_heads=4", "model.n_layers=2", "model.moe_first_dense=1",
          "model.moe_bias_rate=0.05", "data.workers=0"]
  cfg = config.load("deepseek-v3-tiny", sets)
  it = data.batches(cfg)
  host = [next(it) for _ in range(3)]
  it.close()
  fast = {"xla_backend_optimization_level": 0}
  out = {}
  for spec, scan in (("dp=1", "false"), ("tp=2,sp=2,ep=2", "true")):
    setup = step.Setup(config.load("deepseek-v3-tiny", sets + [f"model.scan_layers={scan}"]), mesh_of(spec))
    batches = [setup.device_batch(b) for b in host]
    state = setup.init.lower().compile(fast)()  # the same weights: the stacks are built from the same blocks
    compiled = setup.step.lower(setup.abstract_state(), batches[0]).compile(fast)
    out[spec] = []
    for b in batches:
      state, metrics = compiled(state, b)
      out[spec].append([float(metrics["loss"]), float(metrics["grad_norm"])])
  assert "ring" in step.Setup(cfg, mesh_of("tp=2,sp=2,ep=2")).plan.describe()
  np.testing.assert_allclose(out["tp=2,sp=2,ep=2"], out["dp=1"], rtol=1e-5)


def test_deepseek_v3_parameter_count_equals_transformers():
  """The 671B preset against DeepseekV3ForCausalLM built from the same shapes on the meta device (no memory);
  ours counts 1 dense + 1 MoE layer (abstractly), then the rest by difference."""
  import torch
  import transformers
  m = config.load("deepseek-v3").model
  hc = transformers.DeepseekV3Config(
      vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff, moe_intermediate_size=m.moe_expert_d_ff,
      num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.n_heads,
      n_shared_experts=m.moe_shared_experts, n_routed_experts=m.moe_experts, num_experts_per_tok=m.moe_top_k,
      first_k_dense_replace=m.moe_first_dense, n_group=m.moe_n_group, topk_group=m.moe_topk_group,
      q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
      qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, tie_word_embeddings=False)
  with torch.device("meta"):
    theirs = sum(p.numel() for p in transformers.DeepseekV3ForCausalLM(hc).parameters())
  count = lambda n, k: model_lib.param_count(model_lib.abstract(dataclasses.replace(  # noqa: E731
      m, n_layers=n, moe_first_dense=k, scan_layers=False))[1])
  base, dense, moe = count(1, 1), count(2, 2), count(2, 1)  # shared part + 1 dense; + 2 dense; + 1 dense + 1 MoE
  k, moe_layers = m.moe_first_dense, m.n_layers - m.moe_first_dense
  ours = base + (k - 1) * (dense - base) + moe_layers * (moe - base)
  # the routing bias is a buffer in transformers (not among its parameters), a parameter here
  assert ours - moe_layers * m.moe_experts == theirs


def test_the_mtp_layer_imports_and_exports_in_deepseeks_layout(deepseek, tmp_path):
  """A checkpoint with DeepSeek's MTP layer at index num_hidden_layers (its block like the last MoE layer, enorm,
  hnorm, eh_proj, shared_head.norm, and copies of the embedding and head) imports with model.mtp_layers=1 and
  exports the same tensors, less the two copies of shared weights."""
  import shutil
  from safetensors.numpy import save_file
  d, _, _ = deepseek
  src = _tensors(d / "hf")
  rng = np.random.default_rng(0)
  mtp = {k.replace("model.layers.2.", "model.layers.3."): rng.standard_normal(v.shape).astype(np.float32)
         for k, v in src.items() if k.startswith("model.layers.2.")}
  for name, shape in (("enorm.weight", (32,)), ("hnorm.weight", (32,)), ("eh_proj.weight", (32, 64)),
                      ("shared_head.norm.weight", (32,))):
    mtp[f"model.layers.3.{name}"] = rng.standard_normal(shape).astype(np.float32)
  copies = {"model.layers.3.embed_tokens.weight": src["model.embed_tokens.weight"],
            "model.layers.3.shared_head.head.weight": src["lm_head.weight"]}
  (tmp_path / "hf").mkdir()
  shutil.copyfile(d / "hf" / "config.json", tmp_path / "hf" / "config.json")
  save_file({**src, **mtp, **copies}, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
  H.imported(tmp_path / "hf", tmp_path / "w")
  step_dir = runs.locate(tmp_path / "w", 0)
  cfg = runs.config_of(checkpoint.read_manifest(step_dir))
  assert cfg.model.mtp_layers == 1
  hf_export.run_export(cfg, mesh_of("fsdp=1"), step_dir, tmp_path / "out", "float32", 10**9, tmp_path / "w")
  _bit_identical({**src, **mtp}, _tensors(tmp_path / "out"))
  assert H.config_json(tmp_path / "out")["num_nextn_predict_layers"] == 1
