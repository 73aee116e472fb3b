"""LoRA on an imported Hugging Face model: the base loads, fresh adapters train, the base stays bit-identical;
`hf export --adapter` is a PEFT adapter that `peft` loads onto the `transformers` base with jaxtrain's logits, and
the plain export is the merged model, equal to peft's merge_and_unload."""

import json

import numpy as np
import pytest

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from jaxtrain import hf as hf_command  # noqa: E402
from jaxtrain.core import config  # noqa: E402
from jaxtrain.interop import hf_export  # noqa: E402
from jaxtrain.run import checkpoint, loop, runs  # noqa: E402
from tests import hf_models as H  # noqa: E402
from tests.helpers import mesh_of  # noqa: E402

pytestmark = pytest.mark.slow  # compiles of whole steps: left out of -m 'not slow'

IDS = np.random.default_rng(0).integers(0, 320, (2, 24))
LORA = ["model.lora_rank=4", "model.lora_alpha=8", "model.lora_targets=q,k,v,o,gate,up,down"]


@pytest.fixture(scope="module", params=[False, True], ids=["layers", "scanned"])
def trained(tmp_path_factory, request):
  """(hf dir, workdir): a tiny Llama imported with LoRA on fsdp=2,tp=2 and trained 2 steps there."""
  d = tmp_path_factory.mktemp("lora")
  H.llama(d / "hf", vocab=320)
  sets = [*LORA, "train.batch_size=4", "train.seq_len=32", "optim.lr=3e-2", "optim.warmup_steps=1", "data.workers=0",
          f"model.scan_layers={str(request.param).lower()}"]
  path = H.imported(d / "hf", d / "w", "fsdp=2,tp=2", sets)
  loop.run(config.load(str(path)), mesh_of("fsdp=2,tp=2"), d / "w", "m", stop_at=2)
  return d / "hf", d / "w"


def _flat(tree, prefix=""):
  if not isinstance(tree, dict):
    return {prefix: np.asarray(tree)}
  return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}/{key}").items()}


def test_import_keeps_the_base_and_training_moves_only_the_adapters(trained):
  _, w = trained
  _, _, p0 = H.load(w, step=0)
  _, _, p2 = H.load(w, step=2)
  a, b = _flat(p0), _flat(p2)
  assert a.keys() == b.keys() and any("_lora/lora_a" in k for k in a)
  for k in a:
    if "_lora" not in k:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  assert all(not a[k].any() for k in a if k.endswith("lora_b"))  # fresh adapters: B zero
  assert all(b[k].any() for k in b if k.endswith("lora_b"))  # trained: every B moved


def test_peft_adapter_and_merged_export_match_jaxtrain(trained, tmp_path):
  import torch
  import transformers
  hf_dir, w = trained
  assert hf_command.main(["export", "--workdir", str(w), "--out", str(tmp_path / "adapter"), "--adapter",
                          "--dtype", "float32", "--mesh", "dp=4,tp=2"]) == 0
  conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert conf["peft_type"] == "LORA" and conf["r"] == 4 and conf["lora_alpha"] == 8
  assert conf["base_model_name_or_path"] == str(hf_dir.absolute())
  assert sorted(conf["target_modules"]) == sorted(f"{p}_proj" for p in ("q", "k", "v", "o", "gate", "up", "down"))
  base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
  plain = H.torch_logits(base, IDS)  # before peft injects the adapters into `base` in place
  with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
  _, model, _ = H.load(w, "fsdp=1", step=2)
  ours = H.jax_logits(model, IDS)
  theirs = H.torch_logits(with_adapter, IDS)
  assert H.rel_err(ours, theirs) < 1e-5
  assert H.rel_err(ours, plain) > 1e-3  # the adapters change the function

  cfg_step = runs.locate(w, 2)
  hf_export.run_export(runs.config_of(checkpoint.read_manifest(cfg_step)), mesh_of("tp=2"), cfg_step,
                       tmp_path / "merged", "float32", 10**9, w)
  merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
  folded = with_adapter.merge_and_unload()
  assert H.rel_err(H.torch_logits(merged, IDS), H.torch_logits(folded, IDS)) < 1e-5
  mine, peft_sd = merged.state_dict(), folded.state_dict()
  assert mine.keys() == peft_sd.keys()
  for k in mine:
    np.testing.assert_allclose(mine[k].numpy(), peft_sd[k].numpy(), rtol=1e-5, atol=1e-6, err_msg=k)


def test_adapter_export_of_a_run_without_lora_is_one_line(trained, tmp_path, capsys):
  hf_dir, _ = trained
  H.imported(hf_dir, tmp_path / "plain", "fsdp=1")
  with pytest.raises(SystemExit) as e:
    hf_command.main(["export", "--workdir", str(tmp_path / "plain"), "--out", str(tmp_path / "o"), "--adapter"])
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and "--adapter" in err and "model.lora_rank=0" in err and len(err.splitlines()) == 1


DEEPSEEK_IDS = np.random.default_rng(1).integers(0, 320, (2, 16))
MLA_TARGETS = "q_a,q_b,kv_a,kv_b,o"


@pytest.fixture(scope="module", params=[MLA_TARGETS, f"{MLA_TARGETS},gate,up,down"], ids=["mla", "mla_experts"])
def deepseek_trained(tmp_path_factory, request):
  """(hf dir, workdir): a tiny DeepSeek-V3 (MLA, a dense layer, routed and shared experts) imported with LoRA on
  MLA's projections (and every expert's, the shared expert's, the dense MLP's), trained 2 steps."""
  d = tmp_path_factory.mktemp("lora_deepseek")
  H.deepseek_v3(d / "hf", vocab=320)
  sets = ["model.lora_rank=4", "model.lora_alpha=8", f"model.lora_targets={request.param}", "train.batch_size=4",
          "train.seq_len=16", "optim.lr=3e-2", "optim.warmup_steps=1", "data.workers=0"]
  path = H.imported(d / "hf", d / "w", "fsdp=1", sets)
  loop.run(config.load(str(path)), mesh_of("fsdp=1"), d / "w", "m", stop_at=2)
  return d / "hf", d / "w"


def test_merged_export_of_mla_and_expert_adapters_is_the_adapted_model(deepseek_trained, tmp_path):
  """Plain export folds every adapter (each expert's A (X, in, r) B (X, r, out) included) into its weight: the
  transformers model it writes gives jaxtrain's logits with the adapters, not the base's."""
  import torch
  import transformers
  hf_dir, w = deepseek_trained
  _, _, p2 = H.load(w, step=2)
  assert all(b.any() for k, b in _flat(p2).items() if k.endswith("lora_b"))
  step_dir = runs.locate(w, 2)
  hf_export.run_export(runs.config_of(checkpoint.read_manifest(step_dir)), mesh_of("fsdp=1"), step_dir,
                       tmp_path / "merged", "float32", 10**9, w)
  merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
  base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
  _, model, _ = H.load(w, "fsdp=1", step=2)
  ours = H.jax_logits(model, DEEPSEEK_IDS)
  assert H.rel_err(ours, H.torch_logits(merged, DEEPSEEK_IDS)) < 1e-5
  assert H.rel_err(ours, H.torch_logits(base, DEEPSEEK_IDS)) > 1e-3


def test_peft_adapter_of_mla_or_refused_for_experts(deepseek_trained, tmp_path, capsys):
  """MLA's adapters export as PEFT's on q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj (B's rows in
  HF's RoPE order) and give jaxtrain's logits; adapters on the experts (fused 3-D parameters in transformers) are
  refused in one line."""
  import torch
  import transformers
  hf_dir, w = deepseek_trained
  args = ["export", "--workdir", str(w), "--out", str(tmp_path / "adapter"), "--adapter", "--dtype", "float32",
          "--mesh", "dp=4,tp=2"]
  if "gate" in runs.config_of(checkpoint.read_manifest(runs.locate(w, 2))).model.lora_targets:
    with pytest.raises(SystemExit) as e:
      hf_command.main(args)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert "--adapter" in err and "gate, up, down adapt the MoE experts" in err and "without --adapter" in err
    return
  assert hf_command.main(args) == 0
  conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert sorted(conf["target_modules"]) == ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"]
  base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
  plain = H.torch_logits(base, DEEPSEEK_IDS)
  with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
  _, model, _ = H.load(w, "fsdp=1", step=2)
  ours = H.jax_logits(model, DEEPSEEK_IDS)
  assert H.rel_err(ours, H.torch_logits(with_adapter, DEEPSEEK_IDS)) < 1e-5
  assert H.rel_err(ours, plain) > 1e-3


def _du(path) -> int:
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_qlora_import_quantizes_what_it_read_and_trains(tmp_path, scan):
  """`hf import` with model.lora_base_dtype=nf4 quantizes each base tensor as it is placed (on fsdp=2): the step-0
  base is exactly quant of the plain LoRA import's float32 base (each matrix alone), the checkpoint is smaller, and
  the first train creates the optimizer state around it, moves the adapters and leaves the codes alone."""
  import jax
  import jax.numpy as jnp
  from jaxtrain.model import quant, roles
  H.llama(tmp_path / "hf", vocab=320)
  sets = [*LORA, "train.batch_size=4", "train.seq_len=32", "optim.lr=3e-2", "optim.warmup_steps=1", "data.workers=0",
          f"model.scan_layers={str(scan).lower()}"]
  H.imported(tmp_path / "hf", tmp_path / "lora", "fsdp=2", sets)
  path = H.imported(tmp_path / "hf", tmp_path / "q", "fsdp=2", [*sets, "model.lora_base_dtype=nf4"])
  _, _, plain = H.load(tmp_path / "lora", step=0)
  qcfg, _, deq = H.load(tmp_path / "q", step=0)  # the quantized base dequantized to float32
  got, n = _flat(deq), 0
  for keys, w in jax.tree_util.tree_leaves_with_path(plain):
    role, name = roles.of(qcfg.model, keys), "/" + "/".join(roles.keys_of(keys))
    want = np.asarray(w) if role.quant == "none" else np.asarray(
        quant.dequantize(roles.quantized(role, jnp.asarray(w)), jnp.float32))
    n += role.quant != "none"
    np.testing.assert_array_equal(got[name], want, err_msg=name)
  assert n and _du(tmp_path / "q" / "checkpoints") < _du(tmp_path / "lora" / "checkpoints")
  loop.run(config.load(str(path)), mesh_of("fsdp=2"), tmp_path / "q", "m", stop_at=2)
  after = _flat(H.load(tmp_path / "q", step=2)[2])
  assert all(after[k].any() for k in after if k.endswith("lora_b"))
  for k in got:
    if "_lora" not in k:
      np.testing.assert_array_equal(after[k], got[k], err_msg=k)


LLAMA_PROJECTIONS = {"q_proj": ("attn", "wq"), "k_proj": ("attn", "wk"), "v_proj": ("attn", "wv"),
                     "o_proj": ("attn", "wo"), "gate_proj": ("mlp", "w_gate"), "up_proj": ("mlp", "w_up"),
                     "down_proj": ("mlp", "w_down")}


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
  """(hf dir, workdir, adapter dir): a Llama whose every projection input is whole blocks of 64 (head_dim 64, as
  real models), imported with nf4 on fsdp=2, trained 2 steps, its adapter exported as PEFT's (float32)."""
  pytest.importorskip("bitsandbytes")  # the reference every test of it compares with
  import torch
  import transformers
  d = tmp_path_factory.mktemp("qlora")
  torch.manual_seed(0)
  c = transformers.LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=64, initializer_range=0.2,
                               max_position_embeddings=64, rms_norm_eps=1e-5)
  transformers.LlamaForCausalLM(c).eval().save_pretrained(d / "hf")
  sets = [*LORA, "train.batch_size=4", "train.seq_len=32", "optim.lr=3e-2", "optim.warmup_steps=1", "data.workers=0",
          "model.lora_base_dtype=nf4"]
  path = H.imported(d / "hf", d / "w", "fsdp=2", sets)
  loop.run(config.load(str(path)), mesh_of("fsdp=2"), d / "w", "m", stop_at=2)
  assert hf_command.main(["export", "--workdir", str(d / "w"), "--out", str(d / "adapter"), "--adapter",
                          "--dtype", "float32", "--mesh", "dp=4,tp=2"]) == 0
  return d / "hf", d / "w", d / "adapter"


def _bitsandbytes_nf4(hf_dir, device="cpu"):
  """The checkpoint as transformers loads it quantized by bitsandbytes: nf4, no double quantization, float32
  compute; its Linear4bit modules by name, read before any forward (bitsandbytes' CPU path repacks the weights at its
  first forward)."""
  import torch
  import transformers
  bnb = pytest.importorskip("bitsandbytes")
  q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False,
                                      bnb_4bit_compute_dtype=torch.float32)
  model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, quantization_config=q, device_map=device,
                                                            dtype=torch.float32)
  return model, {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def test_qlora_base_codes_and_dequantized_weights_are_bitsandbytes_own(qlora_run):
  """The QLoRA checkpoint's base is what bitsandbytes makes of the same Hugging Face checkpoint in transformers:
  every projection's 4-bit codes and float32 absmax equal bitsandbytes' (its quantize_4bit, as transformers calls it)
  bit for bit, block for block (`wo`'s blocks stored heads first, torch's rows model axis first), and jaxtrain's
  dequantized weights equal bitsandbytes' own dequantize_4bit of its codes."""
  bnbf = pytest.importorskip("bitsandbytes.functional")
  hf_dir, w, _ = qlora_run
  step_dir = runs.locate(w, 2)
  cfg = runs.config_of(checkpoint.read_manifest(step_dir))
  _, codes = runs.restore_params(cfg, mesh_of("fsdp=1"), step_dir, stored=True)
  _, dense = runs.restore_params(cfg, mesh_of("fsdp=1"), step_dir)
  _, modules = _bitsandbytes_nf4(hf_dir)
  assert len(modules) == 2 * len(LLAMA_PROJECTIONS)
  for name, mod in modules.items():
    layer, proj = int(name.split(".")[2]), name.split(".")[-1]
    block, attr = LLAMA_PROJECTIONS[proj]
    q, dq = codes["layers"][layer][block][attr], dense["layers"][layer][block][attr]
    state = mod.weight.quant_state
    # blocks of 64 along one input axis: wo's (heads, embed, head_dim/2) are torch's (embed, heads, ...) rows
    order = (lambda a: np.swapaxes(a, 0, 1)) if attr == "wo" else (lambda a: a)  # noqa: E731
    np.testing.assert_array_equal(order(np.asarray(q.codes)).reshape(-1), mod.weight.data.numpy().reshape(-1),
                                  err_msg=name)
    np.testing.assert_array_equal(order(np.asarray(q.scales)).reshape(-1), state.absmax.numpy(), err_msg=name)
    theirs_OxI = bnbf.dequantize_4bit(mod.weight.data, state).float().numpy()
    ours = np.asarray(dq)  # (in..., out...): torch's (out, in) is the input axes last, flattened
    n_in = 2 if attr == "wo" else 1
    ours_OxI = np.moveaxis(ours.reshape(int(np.prod(ours.shape[:n_in])), -1), 0, -1)
    np.testing.assert_array_equal(ours_OxI, theirs_OxI, err_msg=name)


def test_qlora_peft_adapter_on_bitsandbytes_dequantized_base_gives_jaxtrain_logits(qlora_run):
  """The exported PEFT adapter, loaded by peft onto the transformers model whose projections are bitsandbytes' own
  dequantization of its nf4 codes (float32 nn.Linear layers: on CPU, bitsandbytes' 4-bit forward (0.50.2, without
  the `kernels` package) repacks the weights at its first call and is not its own dequantized weights' product:
  measured 3.4% off jaxtrain's logits here, 124% if it ran before the adapter was loaded), gives jaxtrain's logits
  (measured 1.7e-6)."""
  import torch
  import transformers
  bnbf = pytest.importorskip("bitsandbytes.functional")
  hf_dir, w, adapter = qlora_run
  _, modules = _bitsandbytes_nf4(hf_dir)
  base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  plain = dict(base.named_modules())
  with torch.no_grad():
    for name, mod in modules.items():
      plain[name].weight.copy_(bnbf.dequantize_4bit(mod.weight.data, mod.weight.quant_state).float())
  with_adapter = peft.PeftModel.from_pretrained(base, adapter).eval()
  _, model, _ = H.load(w, "fsdp=1", step=2)
  assert H.rel_err(H.jax_logits(model, IDS), H.torch_logits(with_adapter, IDS)) < 1e-5


def test_qlora_peft_adapter_through_bitsandbytes_cuda_forward_gives_jaxtrain_logits(qlora_run):
  """Where bitsandbytes' own 4-bit forward is right (CUDA), the adapter on the bitsandbytes-quantized model, run
  through that forward, gives jaxtrain's logits; skipped without a CUDA device for torch."""
  import torch
  if not torch.cuda.is_available():
    pytest.skip("bitsandbytes' CUDA forward: no CUDA device for torch")
  hf_dir, w, adapter = qlora_run
  torch.backends.cuda.matmul.allow_tf32 = False
  base, _ = _bitsandbytes_nf4(hf_dir, device="cuda")
  with_adapter = peft.PeftModel.from_pretrained(base, adapter).eval()
  with torch.no_grad():
    theirs = with_adapter(torch.as_tensor(IDS, device="cuda")).logits.float().cpu().numpy()
  _, model, _ = H.load(w, "fsdp=1", step=2)
  assert H.rel_err(H.jax_logits(model, IDS), theirs) < 1e-4
