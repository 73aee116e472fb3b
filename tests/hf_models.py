"""Tiny random Hugging Face checkpoints built locally (nothing downloaded), and jaxtrain's
view of an imported or trained run, shared by test_hf.py and test_generate.py."""

import json

import jax
import numpy as np
from flax import nnx

from jaxtrain.interop import hf
from jaxtrain.run import checkpoint
from jaxtrain.run import runs
from tests.helpers import mesh_of

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}
# YaRN as Llama and Qwen3 take it (their own rope_theta: 100 puts the ramp inside the tiny heads, e.g. Llama's 4
# frequencies ramp 0, 1/3, 2/3, 1); mscale with mscale_all_dim sets the cos/sin factor, mscale alone is ignored
LLAMA_YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 16,
              "beta_fast": 2.0, "beta_slow": 0.25}
LLAMA_YARN_MSCALE = {**LLAMA_YARN, "mscale": 0.7, "mscale_all_dim": 1.0}
QWEN3_YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 16,
              "mscale": 2.0}
QWEN3_YARN_MSCALE = {**QWEN3_YARN, "beta_fast": 4.0, "beta_slow": 0.5, "mscale": 1.0, "mscale_all_dim": 0.5}


def llama(path, *, tied=False, rope_scaling=None, dtype="float32", vocab=96, seed=0):
  """A 2-layer GQA Llama (4 query heads, 2 kv heads) saved to `path`; returns the torch model."""
  import torch
  import transformers
  torch.manual_seed(seed)
  cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                                 rope_theta=10000.0, rope_scaling=rope_scaling, initializer_range=0.2,
                                 max_position_embeddings=64, rms_norm_eps=1e-5)
  m = transformers.LlamaForCausalLM(cfg).to(getattr(torch, dtype)).eval()
  _perturb_norms(m, seed)
  m.save_pretrained(path)
  return m.float()


def tokenizer_json(path):
  """A small byte-level BPE tokenizer.json, trained locally on a few sentences."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20 + ["hello world, tiny models"], trainer)
  tok.save(str(path))


def stand_in(path):
  """A tiny Llama with its tokenizer.json where the docs name a downloaded checkpoint (tests/docs/test_examples)."""
  llama(path, vocab=320)
  tokenizer_json(path / "tokenizer.json")


def mixtral(path, seed=0):
  import torch
  import transformers
  torch.manual_seed(seed)
  cfg = transformers.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                   num_experts_per_tok=2, initializer_range=0.2, max_position_embeddings=64,
                                   rope_theta=10000.0)
  m = transformers.MixtralForCausalLM(cfg).eval()
  _perturb_norms(m, seed)
  m.save_pretrained(path)
  return m


def mistral(path, *, window=5, seed=0):
  """A 2-layer GQA Mistral whose every layer sees a sliding window of `window` tokens, saved to `path`."""
  import torch
  import transformers
  torch.manual_seed(seed)
  cfg = transformers.MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=window,
                                   initializer_range=0.2, max_position_embeddings=64, rope_theta=10000.0)
  m = transformers.MistralForCausalLM(cfg).eval()
  _perturb_norms(m, seed)
  m.save_pretrained(path)
  return m


def gemma3(path, *, seed=0, layers=6, window=4, **extra):
  """A GQA Gemma 3 text model: every 6th layer global (the rest see `window` tokens), local RoPE base 10 against a
  linearly scaled global 1000, query_pre_attn_scalar 24 (not head_dim 16), tied; saved to `path`."""
  import torch
  import transformers
  torch.manual_seed(seed)
  rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
          "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}}
  cfg = transformers.Gemma3TextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
                                      query_pre_attn_scalar=24, rope_parameters=rope, initializer_range=0.2,
                                      max_position_embeddings=64, **extra)
  m = transformers.Gemma3ForCausalLM(cfg).eval()
  _perturb_norms(m, seed)
  m.save_pretrained(path)
  return m


def _perturb_norms(m, seed):
  """Norm scales start at 1; random ones make a transposed or swapped norm visible."""
  import torch
  g = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, p in m.named_parameters():
      if "norm" in name:
        p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g).to(p.dtype))


def imported(hf_dir, workdir, spec="fsdp=1", extra=()):
  """Imports `hf_dir` into `workdir` on mesh `spec` (float32 compute); returns the config path."""
  plan = hf.plan_import(str(hf_dir), str(workdir), ["model.dtype=float32", *extra], name="m")
  return hf.run_import(plan, mesh_of(spec))


def load(workdir, spec="fsdp=1", step=None):
  """(cfg, model with the restored params, params) of a run's committed checkpoint."""
  step_dir = runs.locate(workdir, step)
  cfg = runs.config_of(checkpoint.read_manifest(step_dir))
  setup, params = runs.restore_params(cfg, mesh_of(spec), step_dir)
  return cfg, nnx.merge(setup.graphdef, params), params


def jax_logits(model, ids):
  ids = np.asarray(ids)
  B, L = ids.shape
  pos = np.broadcast_to(np.arange(L), (B, L))
  return np.asarray(jax.device_get(model(ids, pos, np.ones((B, L), np.int32))))


def torch_logits(m, ids):
  import torch
  with torch.no_grad():
    return m(torch.as_tensor(np.asarray(ids))).logits.float().numpy()


def rel_err(a, b):
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def config_json(path):
  return json.loads((path / "config.json").read_text())


def qwen3(path, *, tied=True, dtype="float32", seed=0, rope_scaling=None, **extra):
  """A 2-layer GQA Qwen3 (q/k norms; head_dim 16, not d_model / heads = 8) saved to `path`; returns the torch model."""
  import torch
  import transformers
  torch.manual_seed(seed)
  cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied,
                                 rope_theta=10000.0, rope_scaling=rope_scaling, initializer_range=0.2,
                                 max_position_embeddings=64, **extra)
  m = transformers.Qwen3ForCausalLM(cfg).to(getattr(torch, dtype)).eval()
  _perturb_norms(m, seed)
  m.save_pretrained(path)
  return m.float()


def qwen3_moe(path, *, norm_topk_prob=False, mlp_only_layers=(0,), layers=3, seed=0):
  """A GQA Qwen3-MoE: 8 fine-grained experts (width 16 beside dense width 64), top-3, the first layer dense;
  norm_topk_prob false (transformers' default) routes by the raw softmax scores."""
  import torch
  import transformers
  torch.manual_seed(seed)
  cfg = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob,
                                    mlp_only_layers=list(mlp_only_layers), initializer_range=0.2,
                                    max_position_embeddings=64, rope_theta=10000.0)
  m = transformers.Qwen3MoeForCausalLM(cfg).eval()
  _perturb_norms(m, seed)
  m.save_pretrained(path)
  return m


DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def deepseek_v3(path, seed=0, q_lora_rank=24, vocab=96):
  """A 3-layer DeepSeek-V3 (MLA with q_lora_rank, YaRN, a dense first layer, 8 routed experts in 4 groups of which
  2 are chosen, a shared expert, routed scaling, a nonzero correction bias) saved to `path`; returns the model."""
  import torch
  import transformers
  torch.manual_seed(seed)
  cfg = transformers.DeepseekV3Config(
      vocab_size=vocab, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
      num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
      kv_lora_rank=16, q_lora_rank=q_lora_rank, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8, n_group=4,
      topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=32, initializer_range=0.2,
      rope_parameters=dict(DEEPSEEK_YARN), rms_norm_eps=1e-5)
  m = transformers.DeepseekV3ForCausalLM(cfg).eval()
  _perturb_norms(m, seed)
  g = torch.Generator().manual_seed(seed + 2)
  with torch.no_grad():
    for name, b in m.named_buffers():
      if name.endswith("e_score_correction_bias"):  # a bias that changes which experts win
        b.copy_(0.05 * torch.randn(b.shape, generator=g))
  m.save_pretrained(path)
  return m


def transformers_greedy(ref, prompts, n: int = 20) -> list[list[int]]:
  """`ref.generate`'s n greedy tokens after each of `prompts` (left-padded with 0), whatever comes out."""
  import torch
  P = max(map(len, prompts))
  ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
  mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
  ref.generation_config.eos_token_id = None
  return ref.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)[:, P:].tolist()


def tensors(directory) -> dict:
  """Every tensor of a directory's safetensors files."""
  from safetensors.numpy import load_file
  out = {}
  for f in sorted(directory.glob("*.safetensors")):
    out.update(load_file(str(f)))
  return out


def bit_identical(a: dict, b: dict) -> None:
  assert sorted(a) == sorted(b)
  for k in a:
    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
    assert np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), k


def exports_back(d, spec: str, out, ref, theirs, ids) -> None:
  """`hf export` of the import in d/"w" (on mesh `spec`) into `out`: its tensors bit for bit d/"hf"'s, and
  transformers loads it as `ref`'s class with exactly the logits `theirs` on `ids`."""
  import torch
  import transformers
  from jaxtrain.interop import hf_export
  step_dir = runs.locate(d / "w", 0)
  hf_export.run_export(runs.config_of(checkpoint.read_manifest(step_dir)), mesh_of(spec), step_dir, out, "float32",
                       10**9, d / "w")
  bit_identical(tensors(d / "hf"), tensors(out))
  back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  assert type(back) is type(ref)
  np.testing.assert_array_equal(torch_logits(back, ids), theirs)
