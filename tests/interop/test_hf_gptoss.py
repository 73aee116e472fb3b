"""GPT-OSS in and out of Hugging Face: a tiny random GptOssForCausalLM (biased attention and experts, sinks,
alternating windows local first, YaRN without truncation, the clamped SwiGLU) imports with the logits of
`transformers`, exports bit-identical (reloading to the same logits), and generates its greedy tokens; its MXFP4
experts (quantized here) import dequantized as `transformers` dequantizes them."""

import numpy as np
import pytest

pytest.importorskip("transformers")

from jaxtrain.core.errors import UserError  # noqa: E402
from jaxtrain.interop import hf, hf_export, hf_gptoss  # noqa: E402
from jaxtrain.run import checkpoint, runs  # noqa: E402
from tests import hf_models as H  # noqa: E402
from tests.helpers import mesh_of  # noqa: E402
from tests.interop.test_generate import _generate  # noqa: E402
from tests.interop.test_hf import IDS, _bit_identical, _tensors  # noqa: E402

pytestmark = pytest.mark.slow  # whole-model compiles

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 90]]  # the first longer than the window
YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 2.0, "beta_slow": 0.25, "truncate": False}


def gpt_oss(path, seed=0):
  """A 2-layer GPT-OSS (a local layer of window 4, then a global one; 4 experts, top 2) with every bias and sink
  random, saved to `path`; returns the torch model."""
  import torch
  import transformers
  torch.manual_seed(seed)
  cfg = transformers.GptOssConfig(
      vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
      rope_parameters=dict(YARN), initializer_range=0.2, max_position_embeddings=64, rms_norm_eps=1e-5,
      attn_implementation="eager")
  m = transformers.GptOssForCausalLM(cfg).eval()
  g = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, p in m.named_parameters():
      if name.endswith(("bias", "sinks")):
        p.copy_(0.5 * torch.randn(p.shape, generator=g))
      elif "gate_up_proj" in name:  # gates and ups past the clamp (7) for some tokens
        p.mul_(8.0)
  H._perturb_norms(m, seed)
  m.save_pretrained(path)
  return m


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  d = tmp_path_factory.mktemp("gpt_oss")
  ref = gpt_oss(d / "hf")
  H.imported(d / "hf", d / "w", "ep=2")
  return d, ref, H.load(d / "w", "ep=2")


def test_gpt_oss_imports_and_exports_with_the_logits_of_transformers(imported, tmp_path):
  import torch
  import transformers
  d, ref, (cfg, model, _) = imported
  m = cfg.model
  assert m.layer_windows() == (4, 0) and m.attention_sinks and m.moe_bias and m.attention_bias
  assert (m.mlp_activation, m.rope_scaling, m.rope_truncate) == ("swiglu_clamped", "yarn", False)
  theirs = H.torch_logits(ref, IDS)
  assert H.rel_err(H.jax_logits(model, IDS), theirs) < 1e-5
  step_dir = runs.locate(d / "w", 0)
  hf_export.run_export(runs.config_of(checkpoint.read_manifest(step_dir)), mesh_of("ep=2"), step_dir,
                       tmp_path / "out", "float32", 10**9, d / "w")
  _bit_identical(_tensors(d / "hf"), _tensors(tmp_path / "out"))
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                           attn_implementation="eager").eval()
  assert type(back) is type(ref)
  np.testing.assert_array_equal(H.torch_logits(back, IDS), theirs)


def test_gpt_oss_greedy_generation_equals_transformers(imported):
  d, ref, loaded = imported
  assert _generate(loaded, PROMPTS, "ep=2") == H.transformers_greedy(ref, PROMPTS, 20)


def test_other_quantizations_are_refused_in_one_line(tmp_path):
  gpt_oss(tmp_path / "hf")
  fields = H.config_json(tmp_path / "hf")
  fields["quantization_config"] = {"quant_method": "bitsandbytes"}
  with pytest.raises(UserError, match="quant_method='bitsandbytes' is not supported; allowed: mxfp4"):
    hf.model_keys(fields, "config.json")


def _quantize(w_XxIxO):
  """A local MXFP4 quantizer (round to the nearest e2m1 value under a power-of-two scale per 32 inputs): blocks
  (X, O, I/32, 16) uint8, low nibble first, and e8m0 scales (X, O, I/32) uint8."""
  codes = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
  X, In, O = w_XxIxO.shape
  w = np.swapaxes(w_XxIxO, 1, 2).reshape(X, O, In // 32, 32)
  exp = np.ceil(np.log2(np.maximum(np.abs(w).max(-1), 1e-30) / 6)).astype(np.int32)
  idx = np.abs(w[..., None] / np.exp2(exp)[..., None, None] - codes).argmin(-1).astype(np.uint8)
  return (idx[..., 0::2] | (idx[..., 1::2] << 4)).astype(np.uint8), (exp + 127).astype(np.uint8)


def test_mxfp4_dequantizes_as_transformers_and_by_hand():
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors
  import torch
  rng = np.random.default_rng(0)
  blocks = rng.integers(0, 256, (3, 5, 2, 16), dtype=np.uint8)
  scales = rng.integers(120, 134, (3, 5, 2), dtype=np.uint8)
  want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
  np.testing.assert_array_equal(hf_gptoss.dequantize(blocks, scales), want.numpy())
  one = hf_gptoss.dequantize(np.full((1, 1, 1, 16), 0xB1, np.uint8), np.full((1, 1, 1), 128, np.uint8))
  assert one[0, :2, 0].tolist() == [1.0, -3.0]  # low nibble 1: 0.5, high 0xB: -1.5; times 2^(128 - 127)


def test_an_mxfp4_checkpoint_imports_dequantized_with_the_logits_of_transformers(tmp_path):
  import json
  import torch
  from safetensors.numpy import load_file, save_file
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors
  ref = gpt_oss(tmp_path / "hf")
  f = next((tmp_path / "hf").glob("*.safetensors"))
  tensors = load_file(str(f))
  for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
    blocks, scales = _quantize(tensors.pop(name).astype(np.float32))
    tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    with torch.no_grad():  # the reference computes with what the quantized file holds
      ref.get_parameter(name).copy_(convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                               dtype=torch.float32))
  save_file(tensors, str(f), metadata={"format": "pt"})
  fields = H.config_json(tmp_path / "hf")
  fields["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
  (tmp_path / "hf" / "config.json").write_text(json.dumps(fields))
  H.imported(tmp_path / "hf", tmp_path / "w")
  cfg, model, params = H.load(tmp_path / "w")
  gu = ref.model.layers[0].mlp.experts.gate_up_proj.detach().numpy()
  np.testing.assert_array_equal(np.asarray(params["layers"][0]["mlp"]["w_up"]), gu[..., 1::2])
  assert H.rel_err(H.jax_logits(model, IDS), H.torch_logits(ref, IDS)) < 1e-5


@pytest.mark.parametrize("sets,msg", [
    (["model.mlp_activation=swiglu_clamped"], "model.mlp_activation='swiglu_clamped': a llama checkpoint cannot"),
    (["model.attention_bias=true"], "model.attention_bias=True: a llama checkpoint cannot hold it"),
    (["model.moe_experts=4", "model.moe_bias=true"], "model.attention_sinks=False: a gpt_oss checkpoint always"),
])
def test_what_no_checkpoint_family_holds_is_refused_on_export(sets, msg):
  from jaxtrain.core import config
  with pytest.raises(UserError, match=msg):
    hf.hf_config(config.load("tiny", sets), {}, "float32")
