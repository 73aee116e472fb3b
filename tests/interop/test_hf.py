"""Hugging Face import/export: logits parity with `transformers`, bit-exact round trips,
sharded import, resuming training from an import, bad input, preset parameter counts."""

import dataclasses
import json
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")

from jaxtrain import hf as hf_command
from jaxtrain.interop import hf, hf_export
from jaxtrain.run import loop
from jaxtrain.run import checkpoint
from jaxtrain.core import config
from jaxtrain.model import transformer as model_lib
from jaxtrain.run import runs  # noqa: E402
from tests import hf_models as H  # noqa: E402
from tests.helpers import mesh_of  # noqa: E402

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'

IDS = np.random.default_rng(0).integers(0, 96, (2, 24))  # 24 positions: 3x the llama3 original context (8)


@pytest.mark.parametrize("tied,scaling,spec", [(False, None, "fsdp=1"), (True, None, "fsdp=2,tp=2"),
                                               (False, H.LLAMA3_ROPE, "fsdp=2,tp=2"), (True, H.LLAMA3_ROPE, "fsdp=1")])
def test_llama_logits_match_transformers_after_import(tmp_path, tied, scaling, spec):
  ref = H.llama(tmp_path / "hf", tied=tied, rope_scaling=scaling)
  H.imported(tmp_path / "hf", tmp_path / "w", spec)
  cfg, model, _ = H.load(tmp_path / "w", spec)
  assert cfg.model.tie_embeddings == tied and cfg.model.rope_scaling == ("llama3" if scaling else "none")
  assert H.rel_err(H.jax_logits(model, IDS), H.torch_logits(ref, IDS)) < 1e-5


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
  d = tmp_path_factory.mktemp("mixtral")
  ref = H.mixtral(d / "hf")
  H.imported(d / "hf", d / "w", "fsdp=2,tp=2")
  return d, ref


def test_mixtral_logits_match_transformers_after_import(mixtral):
  d, ref = mixtral
  cfg, model, _ = H.load(d / "w", "fsdp=2,tp=2")
  assert cfg.model.moe_dropless  # HF Mixtral never drops tokens
  assert H.rel_err(H.jax_logits(model, IDS), H.torch_logits(ref, IDS)) < 1e-5


_tensors, _bit_identical = H.tensors, H.bit_identical


def test_round_trip_is_bit_identical(tmp_path, mixtral):
  import torch
  import transformers
  # Llama in bfloat16 (the usual checkpoint dtype), exported in several files.
  H.llama(tmp_path / "hf", dtype="bfloat16", rope_scaling=H.LLAMA3_ROPE)
  H.imported(tmp_path / "hf", tmp_path / "w", "fsdp=2")
  step_dir = runs.locate(tmp_path / "w", 0)
  cfg = runs.config_of(checkpoint.read_manifest(step_dir))
  hf_export.run_export(cfg, mesh_of("fsdp=2"), step_dir, tmp_path / "out", "bfloat16", 20_000, tmp_path / "w")
  assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
  _bit_identical(_tensors(tmp_path / "hf"), _tensors(tmp_path / "out"))
  # Mixtral in float32, and the export loads in transformers as the same function.
  d, ref = mixtral
  step_dir = runs.locate(d / "w", 0)
  cfg = runs.config_of(checkpoint.read_manifest(step_dir))
  hf_export.run_export(cfg, mesh_of("fsdp=1"), step_dir, tmp_path / "mx", "float32", 10**9, d / "w")
  _bit_identical(_tensors(d / "hf"), _tensors(tmp_path / "mx"))
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mx", dtype=torch.float32)
  assert type(back).__name__ == "MixtralForCausalLM"
  np.testing.assert_array_equal(H.torch_logits(back, IDS), H.torch_logits(ref, IDS))


def _train(cfg_path, workdir, spec, capsys):
  cfg = config.load(str(cfg_path))
  loop.run(cfg, mesh_of(spec), workdir, "m", stop_at=2)
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return records, capsys.readouterr().out


def test_import_on_a_mesh_then_train_equals_single_device_and_exports(tmp_path, capsys):
  """Import (with the checkpoint's tokenizer.json) on fsdp=2,tp=2 and on one device, train
  2 steps from each: the same losses and gradient norms, the run resumed from step 0. The
  trained checkpoint then exports and loads in transformers as the same function."""
  import torch
  import transformers
  H.llama(tmp_path / "hf", vocab=320, tied=True, rope_scaling=H.LLAMA3_ROPE)
  H.tokenizer_json(tmp_path / "hf" / "tokenizer.json")
  sets = ["train.batch_size=4", "train.seq_len=32", "train.lr=1e-3", "data.workers=0"]
  runs_ = {}
  for spec in ("fsdp=2,tp=2", "fsdp=1"):
    w = tmp_path / spec.replace(",", "_")
    path = H.imported(tmp_path / "hf", w, spec, sets)
    cfg = config.load(str(path))
    assert cfg.data.tokenizer == str((w / "tokenizer.json").absolute()) and (w / "tokenizer.json").is_file()
    records, out = _train(path, w, spec, capsys)
    assert f"resumed from {w.absolute() / 'checkpoints' / '0'} at step 0" in out
    runs_[spec] = records
  a, b = runs_["fsdp=2,tp=2"], runs_["fsdp=1"]
  assert [r["step"] for r in a] == [1, 2] and not any(r["skipped"] for r in a)
  for ra, rb in zip(a, b):
    np.testing.assert_allclose([ra["loss"], ra["grad_norm"]], [rb["loss"], rb["grad_norm"]], rtol=1e-5)
  assert a[1]["loss"] != a[0]["loss"]  # the step moved the parameters

  w = tmp_path / "fsdp=2_tp=2"
  step_dir = runs.locate(w, 2)
  hf_export.run_export(runs.config_of(checkpoint.read_manifest(step_dir)), mesh_of("fsdp=2,tp=2"), step_dir,
                tmp_path / "out", "float32", 10**9, w)
  assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
  _, model, _ = H.load(w, "fsdp=1", step=2)
  ids = np.random.default_rng(1).integers(0, 320, (2, 24))
  assert H.rel_err(H.jax_logits(model, ids), H.torch_logits(back, ids)) < 1e-5


def _one_line_exit_2(capsys, argv):
  with pytest.raises(SystemExit) as e:
    hf_command.main(argv)
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and len(err.splitlines()) == 1, err
  return err


@pytest.fixture(scope="module")
def sharded_hf(tmp_path_factory):
  d = tmp_path_factory.mktemp("sharded") / "hf"
  H.llama(d)
  # Re-save in two files with an index, as large checkpoints come.
  from safetensors.numpy import load_file, save_file
  t = load_file(str(d / "model.safetensors"))
  (d / "model.safetensors").unlink()
  names = sorted(t)
  parts = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
  for f, ns in parts.items():
    save_file({n: t[n] for n in ns}, str(d / f), metadata={"format": "pt"})
  (d / hf.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {n: f for f, ns in parts.items() for n in ns}}))
  return d


def _edited(src, dst, **changes):
  shutil.copytree(src, dst)
  c = H.config_json(dst)
  c.update(changes)
  (dst / "config.json").write_text(json.dumps(c))
  return dst


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, sharded_hf):
  w = str(tmp_path / "w")
  # The sharded copy imports fine (index + 2 files) ...
  H.imported(sharded_hf, tmp_path / "ok")
  # ... but not with a shard missing,
  missing = tmp_path / "missing"
  shutil.copytree(sharded_hf, missing)
  (missing / "model-00002-of-00002.safetensors").unlink()
  err = _one_line_exit_2(capsys, ["import", str(missing), "--workdir", w])
  assert "model-00002-of-00002.safetensors is missing" in err
  # an index that is JSON but not an object,
  (missing / "model.safetensors.index.json").write_text("[]")
  err = _one_line_exit_2(capsys, ["import", str(missing), "--workdir", w])
  assert "not a valid safetensors index" in err
  # a shape that config.json does not imply,
  err = _one_line_exit_2(capsys, ["import", str(_edited(sharded_hf, tmp_path / "shape", intermediate_size=48)),
                                  "--workdir", w])
  assert "tensor model.layers.0.mlp.gate_proj.weight has shape [64, 32], config.json implies [48, 32]" in err
  # an architecture or a field we do not have.
  err = _one_line_exit_2(capsys, ["import", str(_edited(sharded_hf, tmp_path / "gpt2", model_type="gpt2")),
                                  "--workdir", w])
  assert "model_type='gpt2' is not supported; supported: llama, mistral, mixtral, " in err
  err = _one_line_exit_2(capsys, ["import", str(_edited(sharded_hf, tmp_path / "bias", attention_bias=True)),
                                  "--workdir", w])
  assert "attention_bias=True is not supported" in err
  err = _one_line_exit_2(capsys, ["import", str(_edited(sharded_hf, tmp_path / "yarn",
                                                        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4})),
                                  "--workdir", w])
  assert "yarn rope needs a numeric factor" in err
  assert not (tmp_path / "w").exists()  # nothing written before every check passed


def yarn_round_trip(tmp_path, ref, rope, spec):
  """`tmp_path / "hf"` (holding `ref`, built with YaRN `rope`) imported on `spec` gives transformers' logits; its
  float32 export holds the same rope parameters as transformers reads them and gives the same logits again."""
  import torch
  import transformers
  H.imported(tmp_path / "hf", tmp_path / "w", spec)
  cfg, model, _ = H.load(tmp_path / "w", spec)
  theirs = H.torch_logits(ref, IDS)
  assert H.rel_err(H.jax_logits(model, IDS), theirs) < 1e-5
  step_dir = runs.locate(tmp_path / "w", 0)
  hf_export.run_export(cfg, mesh_of(spec), step_dir, tmp_path / "out", "float32", 10**9, tmp_path / "w")
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
  assert type(back) is type(ref)
  assert {k: back.config.rope_parameters.get(k) for k in rope} == rope
  np.testing.assert_array_equal(H.torch_logits(back, IDS), theirs)


@pytest.mark.parametrize("rope,spec", [(H.LLAMA_YARN, "fsdp=1"), (H.LLAMA_YARN_MSCALE, "fsdp=2,tp=2")],
                         ids=["betas", "mscale"])
def test_llama_yarn_imports_and_exports_as_yarn(tmp_path, rope, spec):
  ref = H.llama(tmp_path / "hf", rope_scaling=dict(rope))
  yarn_round_trip(tmp_path, ref, rope, spec)


_YARN = H.LLAMA_YARN
_NO_ORIGINAL = {k: v for k, v in _YARN.items() if k != "original_max_position_embeddings"}
# config.json edits of a saved YaRN Llama (rope_parameters LLAMA_YARN, max_position_embeddings 64); None: left out
YARN_EDITS = {
    "original-from-max-position": {"rope_parameters": _NO_ORIGINAL},
    "original-from-the-family-default": {"rope_parameters": _NO_ORIGINAL, "max_position_embeddings": None},
    "top-level-original-wins": {"original_max_position_embeddings": 4},
    "theta-from-top-level": {"rope_parameters": {k: v for k, v in _YARN.items() if k != "rope_theta"},
                             "rope_theta": 100.0},
    "legacy-rope-scaling": {"rope_parameters": None, "rope_theta": 100.0,
                            "rope_scaling": {"type": "yarn", **{k: v for k, v in _YARN.items()
                                                                if k not in ("rope_type", "rope_theta")}}},
    "rope-scaling-wins": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_scaling": _YARN},
    "factor-from-max-position": {"rope_parameters": {**_YARN, "factor": None}, "max_position_embeddings": 128},
    "zero-betas-are-defaults": {"rope_parameters": {**_YARN, "beta_fast": 0, "beta_slow": 0}},
}


@pytest.fixture(scope="module")
def llama_yarn(tmp_path_factory):
  d = tmp_path_factory.mktemp("yarn") / "hf"
  H.llama(d, rope_scaling=dict(H.LLAMA_YARN))
  return d


@pytest.mark.parametrize("edit", sorted(YARN_EDITS))
def test_yarn_fields_left_out_or_elsewhere_are_read_as_transformers_reads_them(tmp_path, llama_yarn, edit):
  """cos and sin at positions 0..63 (past the original context, 16) equal transformers' rotary embedding of the
  edited config.json."""
  import torch
  import transformers
  c = {**H.config_json(llama_yarn), **YARN_EDITS[edit]}
  shutil.copytree(llama_yarn, tmp_path / "hf")
  (tmp_path / "hf" / "config.json").write_text(json.dumps({k: v for k, v in c.items() if v is not None}))
  ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
  pos = torch.arange(64)[None]
  with torch.no_grad():
    cos, sin = ref.model.rotary_emb(torch.zeros(1), pos)
  cfg = hf.plan_import(str(tmp_path / "hf"), str(tmp_path / "w"), ["model.dtype=float32"]).cfg
  sin_ours, cos_ours = (np.asarray(t)[:, :, 0] for t in model_lib.rope_tables(pos.numpy(), cfg.model))
  half = cfg.model.head_dim // 2
  np.testing.assert_allclose(cos_ours, cos.numpy()[..., :half], rtol=0, atol=2e-6)
  np.testing.assert_allclose(sin_ours, sin.numpy()[..., :half], rtol=0, atol=2e-6)


def test_hf_config_defaults_are_transformers_defaults():
  """The family defaults import fills in where config.json leaves out rope_theta or max_position_embeddings."""
  import transformers
  from jaxtrain.interop import hf_rope
  for family, (theta, max_position) in hf_rope.DEFAULTS.items():
    c = transformers.AutoConfig.for_model(family)
    assert (c.rope_parameters["rope_theta"], c.max_position_embeddings) == (theta, max_position), family


@pytest.mark.parametrize("changes,msg", [
    ({"truncate": None}, "truncate=None is not supported; allowed: true or false"),  # false: GPT-OSS's
    ({"attention_factor": 1.5}, "attention_factor=1.5 is not supported; allowed: null"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported; allowed: 1"),
    ({"factor": 0.5}, "factor=0.5 is not supported; allowed: a number >= 1"),
    ({"factor": "4"}, "factor='4' is not supported; allowed: a number >= 1"),
], ids=["truncate-null", "attention-factor", "partial-rotary", "factor-below-1", "factor-string"])
def test_yarn_variants_jaxtrain_cannot_hold_are_one_line_and_exit_2(tmp_path, capsys, llama_yarn, changes, msg):
  rope = {**H.config_json(llama_yarn)["rope_parameters"], **changes}
  src = _edited(llama_yarn, tmp_path / "hf", rope_parameters=rope)
  assert msg in _one_line_exit_2(capsys, ["import", str(src), "--workdir", str(tmp_path / "w")])
  assert not (tmp_path / "w").exists()


# Published parameter counts (Meta's model cards / HF configs).
PRESETS = {"llama3.2-1b": 1_235_814_400, "llama3.1-8b": 8_030_261_248, "llama3.1-70b": 70_553_706_496,
           "llama3.1-405b": 405_853_388_800, "llama3-8b": 8_030_261_248}


def _count(m):
  return model_lib.param_count(model_lib.abstract(m)[1])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_parameter_counts_are_exact(name):
  """The model's own parameter shapes, counted exactly: dense layers are identical, so the
  count of L layers is count(1 layer) + (L - 1) * (count(2 layers) - count(1 layer)) (tracing
  126 layers of 405B abstractly takes minutes)."""
  cfg = config.load(name)
  m = cfg.model
  one, two = _count(dataclasses.replace(m, n_layers=1)), _count(dataclasses.replace(m, n_layers=2))
  assert one + (m.n_layers - 1) * (two - one) == PRESETS[name]
  if name.startswith("llama3."):
    assert (m.rope_scaling, m.rope_low_freq_factor, m.rope_high_freq_factor, m.rope_original_max_position,
            m.rope_theta) == ("llama3", 1.0, 4.0, 8192, 500000.0)
    assert m.rope_factor == (32.0 if name == "llama3.2-1b" else 8.0)
  else:
    assert m.rope_scaling == "none"


def test_checkpoints_from_before_the_rope_keys_still_resume():
  """A fingerprint saved before model.rope_* existed matches when they keep their defaults."""
  cfg = config.load("tiny")
  now = checkpoint.fingerprint(cfg, "tok", "data")
  before = {**now, "model": {k: v for k, v in now["model"].items() if not k.startswith("rope_") or k == "rope_theta"}}
  assert checkpoint.mismatches(before, now) == {}
  later = checkpoint.fingerprint(config.load("tiny", ["model.rope_scaling=llama3"]), "tok", "data")
  assert checkpoint.mismatches(before, later) == {"model": "model.rope_scaling: 'none' -> 'llama3'"}


def test_scanned_import_reads_each_device_part_once(tmp_path, mixtral, monkeypatch):
  """Every device reads only its own part of each stacked parameter: the bytes read on 8 devices stay
  about one file size, and the imported model still matches transformers."""
  d, ref = mixtral
  real, read = hf.safetensors_api(), [0]

  class Counted:  # safe_open, counting the bytes of every tensor (or part of one) it hands out
    def __init__(self, *a, **kw):
      self.f = real.safe_open(*a, **kw)

    def __enter__(self):
      self.st = self.f.__enter__()
      return self

    def __exit__(self, *exc):
      return self.f.__exit__(*exc)

    def keys(self):
      return self.st.keys()

    def get_tensor(self, name):
      a = self.st.get_tensor(name)
      read[0] += a.nbytes
      return a

    def get_slice(self, name):
      part = self.st.get_slice(name)

      class Part:
        get_shape, get_dtype = part.get_shape, part.get_dtype

        def __getitem__(self, index):
          a = part[index]
          read[0] += a.nbytes
          return a
      return Part()
  monkeypatch.setattr(hf, "safetensors_api", lambda: type("Module", (), {"safe_open": Counted}))
  spec = "fsdp=2,tp=2,expert=2"
  H.imported(d / "hf", tmp_path / "w", spec, extra=["model.scan_layers=true"])
  size = sum(f.stat().st_size for f in (d / "hf").glob("*.safetensors"))
  assert 0.9 * size < read[0] < 1.1 * size, (read[0], size)
  cfg, model, _ = H.load(tmp_path / "w", spec)
  assert H.rel_err(H.jax_logits(model, IDS), H.torch_logits(ref, IDS)) < 1e-5
