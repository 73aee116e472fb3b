"""Bad config values, flags and Hugging Face config.json fields (issue 38, config part): each is one line on stderr
and exit 2, never a traceback, never silently taken with another meaning; one parametrized test per class."""

import json
import shutil

import pytest

from jaxtrain import bench, generate, hf as hf_command, inspect, train
from jaxtrain.core import config
from jaxtrain.core.errors import UserError
from jaxtrain.parallel import mesh as mesh_lib

FULL = "\uff16"  # full-width 6: Python's int() reads it as 6


def one_line_exit_2(capsys, main, argv, *words):
  """The house check: exit 2, exactly one stderr line naming `words`, no traceback."""
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    main(argv)
  err = capsys.readouterr().err
  lines = err.strip().splitlines()
  assert e.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
  for w in words:
    assert w in lines[0], lines[0]
  return lines[0]


def _toml(tmp_path, text, name="c.toml"):
  if tmp_path.is_dir():  # not while the case names are collected
    (tmp_path / name).write_text(text)
  return str(tmp_path / name)


# -- tracebacks before: now one line, exit 2 -------------------------------------------------------------------------

def _traceback_cases(tmp):
  w = ["--workdir", str(tmp / "run")]
  export = ["export", "--workdir", str(tmp / "run"), "--out", str(tmp / "out")]
  return {
      # the issue's
      "mesh-double-minus": (train.main, ["--mesh", "dp=--1", *w], ["dp=--1", "positive integer"]),
      "set-double-minus": (train.main, ["--set", "train.seed=--5", *w], ["train.seed='--5'", "not an integer"]),
      "max-shard-nan": (hf_command.main, [*export, "--max-shard-gb", "nan"], ["--max-shard-gb nan"]),
      "max-shard-inf": (hf_command.main, [*export, "--max-shard-gb", "inf"], ["--max-shard-gb inf"]),
      "max-shard-zero": (hf_command.main, [*export, "--max-shard-gb", "0"], ["--max-shard-gb 0.0"]),
      "max-shard-negative": (hf_command.main, [*export, "--max-shard-gb", "-1"], ["--max-shard-gb -1.0"]),
      # ours
      "mesh-double-plus": (inspect.main, ["--mesh", "dp=++2"], ["dp=++2", "positive integer"]),
      "mesh-minus-plus": (inspect.main, ["--mesh", "tp=-+1"], ["tp=-+1", "positive integer"]),
      "set-plus-minus": (train.main, ["--set", "train.steps=+-3", *w], ["train.steps='+-3'", "not an integer"]),
      "set-underscore-only": (train.main, ["--set", "train.steps=_", *w], ["train.steps='_'", "not an integer"]),
      "set-trailing-underscore": (train.main, ["--set", "train.steps=1_", *w], ["train.steps='1_'"]),
      "profile-steps-double-minus": (train.main, ["--set", "run.profile_steps=--1", *w], ["run.profile_steps='--1'"]),
      # ours, one line already before: kept so
      "set-negative-width": (train.main, ["--set", "model.d_model=-4", *w], ["model.d_model=-4", "minimum"]),
      "set-lr-nan": (train.main, ["--set", "optim.lr=nan", *w], ["optim.lr=nan", "finite"]),
  }


@pytest.mark.parametrize("case", sorted(_traceback_cases(__import__("pathlib").Path("."))))
def test_what_was_a_traceback_is_one_line_exit_2(case, tmp_path, capsys):
  main, argv, words = _traceback_cases(tmp_path)[case]
  one_line_exit_2(capsys, main, argv, *words)
  assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()


# -- HF config.json fields: missing or ill-typed is one line naming the field and the file ----------------------------

@pytest.fixture(scope="module")
def llama_hf(tmp_path_factory):
  pytest.importorskip("transformers")
  from tests import hf_models as H
  d = tmp_path_factory.mktemp("llama") / "hf"
  H.llama(d)
  return d


HF_CONFIG_CASES = {
    # the issue's: Llama tensors under model_type=deepseek_v3 (KeyError: 'kv_lora_rank')
    "llama-as-deepseek": ({"model_type": "deepseek_v3"}, ["is missing; it must be an integer"]),
    # ours
    "hidden-size-string": ({"hidden_size": "32"}, ["hidden_size='32'", "an integer"]),
    "heads-zero": ({"num_attention_heads": 0}, ["num_attention_heads=0", "an integer >= 1"]),
    "kv-heads-float": ({"num_key_value_heads": 2.0}, ["num_key_value_heads=2.0"]),
    "kv-heads-do-not-divide": ({"num_key_value_heads": 3}, ["model.n_kv_heads=3 must divide"]),
    "eps-string": ({"rms_norm_eps": "1e-5"}, ["rms_norm_eps='1e-5'", "a number"]),
    "tie-string": ({"tie_word_embeddings": "yes"}, ["tie_word_embeddings='yes'", "true or false"]),
    "max-position-string": ({"max_position_embeddings": "64",
                             "rope_scaling": {"rope_type": "yarn", "factor": None}},
                            ["max_position_embeddings='64'"]),
    "layer-types-number": ({"layer_types": 5}, ["layer_types=5", "a list"]),
    "deepseek-rank-string": ({"model_type": "deepseek_v3", "kv_lora_rank": "16", "q_lora_rank": None,
                              "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8},
                             ["kv_lora_rank='16'"]),
    "qwen3-moe-dense-layers-string": ({"model_type": "qwen3_moe", "num_experts": 4, "mlp_only_layers": "0"},
                                      ["mlp_only_layers='0'", "a list of integers"]),
    "rope-theta-nan": ({"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}}, ["rope_theta=nan"]),
    "eps-infinite": ({"rms_norm_eps": float("inf")}, ["rms_norm_eps=inf"]),
    "vocab-missing": ({"vocab_size": None}, ["vocab_size is missing"]),
}


@pytest.mark.parametrize("case", sorted(HF_CONFIG_CASES))
def test_hf_config_fields_missing_or_ill_typed_are_one_line(case, llama_hf, tmp_path, capsys):
  changes, words = HF_CONFIG_CASES[case]
  d = tmp_path / "hf"
  shutil.copytree(llama_hf, d)
  c = json.loads((d / "config.json").read_text())
  c.update(changes)
  (d / "config.json").write_text(json.dumps(c))
  line = one_line_exit_2(capsys, hf_command.main, ["import", str(d), "--workdir", str(tmp_path / "w")], *words)
  assert str(d / "config.json") in line
  assert not (tmp_path / "w").exists()


def test_hf_config_that_is_not_an_object_is_one_line(llama_hf, tmp_path, capsys):
  d = tmp_path / "hf"
  shutil.copytree(llama_hf, d)
  (d / "config.json").write_text("[1, 2]")
  one_line_exit_2(capsys, hf_command.main, ["import", str(d), "--workdir", str(tmp_path / "w")],
                  "config.json: must hold a JSON object")


# -- accepted silently before: now exit 2 ------------------------------------------------------------------------------

def _silent_cases(tmp):
  w = ["--workdir", str(tmp / "run")]
  gen = ["--workdir", str(tmp / "run")]
  export = ["export", "--workdir", str(tmp / "run"), "--out", str(tmp / "out")]
  preset = lambda text, name: ["--mesh", _toml(tmp, text, name)]  # noqa: E731
  cfg = lambda text, name: ["--config", _toml(tmp, text, name)]  # noqa: E731
  unknown = "run.xla_flags_extra=--xla_jaxtrain_no_such_flag=1"
  return {
      # conflicting duplicate keys (the issue's, then ours)
      "lr-twice-renamed": (train.main, ["--set", "train.lr=1e-3", "--set", "optim.lr=2e-3", *w],
                           ["--set train.lr=1e-3", "--set optim.lr=2e-3", "optim.lr"]),
      "log-every-twice-renamed": (train.main, ["--set", "run.log_every=2", "--set", "train.log_every=3", *w],
                                  ["run.log_every=2", "train.log_every=3"]),
      "toml-old-and-new-name": (train.main, [*cfg("[train]\nlr = 1e-3\n[optim]\nlr = 2e-3\n", "lr.toml"), *w],
                                ["[train] lr = 0.001", "[optim] lr = 0.002"]),
      "toml-duplicate-in-table": (train.main, [*cfg("[train]\nsteps = 3\nsteps = 4\n", "dup.toml"), *w],
                                  ["not valid TOML"]),
      "toml-unknown-section": (train.main, [*cfg("[trian]\nsteps = 3\n", "sec.toml"), *w],
                               ["unknown config section 'trian'"]),
      # mesh sizes that are not integers
      "preset-size-string": (inspect.main, preset('[axes]\ndata = "2"\n', "s.toml"), ["data = '2'", "not a size"]),
      "preset-size-bool": (inspect.main, preset("[axes]\ndata = true\n", "b.toml"), ["data = True", "not a size"]),
      "preset-size-float": (inspect.main, preset("[axes]\ndata = 2.0\n", "f.toml"), ["data = 2.0", "not a size"]),
      "preset-dcn-string": (inspect.main, preset('[axes]\ndata = 2\n[dcn]\ndata = "2"\n', "d.toml"),
                            ["dcn.data = '2'"]),
      "mesh-fraction": (inspect.main, ["--mesh", "dp=1.5"], ["dp=1.5", "positive integer"]),
      "mesh-empty-size": (inspect.main, ["--mesh", "dp="], ["dp=", "positive integer"]),
      "set-exponent-int": (train.main, ["--set", "train.steps=1e3", *w], ["train.steps='1e3'", "not an integer"]),
      # unknown XLA flags
      "xla-unknown-flag": (train.main, ["--set", unknown, *w], ["--xla_jaxtrain_no_such_flag=1", "xla_flags_unknown"]),
      "xla-unknown-among-known": (inspect.main, ["--set", "run.xla_flags_extra=--xla_jaxtrain_other=2 "
                                                 "--xla_gpu_enable_latency_hiding_scheduler=true"],
                                  ["--xla_jaxtrain_other=2"]),
      # empty list items
      "allow-mismatch-empty": (train.main, ["--allow-mismatch", "model,,train", *w], ["'model,,train'", "empty"]),
      "allow-mismatch-trailing": (train.main, ["--allow-mismatch", "model,", *w], ["'model,'", "item 2 of 2"]),
      "prompt-ids-empty": (generate.main, [*gen, "--prompt-ids", "1,,2"], ["--prompt-ids '1,,2'", "empty"]),
      "prompt-ids-leading": (generate.main, [*gen, "--prompt-ids", ",1"], ["--prompt-ids ',1'", "item 1 of 2"]),
      "prompt-ids-blank-item": (generate.main, [*gen, "--prompt-ids", "1, ,2"], ["item 2 of 3 is empty"]),
      "mesh-empty-entry": (inspect.main, ["--mesh", "dp=2,,tp=2"], ["'dp=2,,tp=2'", "empty"]),
      "baseline-empty": (bench.main, ["--baseline", "minimal,", *w], ["--baseline 'minimal,'", "empty"]),
      # non-ASCII digits (the issue's, then ours)
      "export-step-full-width": (hf_command.main, [*export, "--step", FULL], ["--step", FULL, "ASCII digits"]),
      "generate-step-full-width": (generate.main, [*gen, "--prompt-ids", "1", "--step", FULL], ["ASCII digits"]),
      "train-steps-full-width": (train.main, ["--steps", FULL, *w], ["--steps", "ASCII digits"]),
      "set-full-width": (train.main, ["--set", f"train.steps=1{FULL}", *w], [f"train.steps='1{FULL}'", "ASCII"]),
      "set-float-full-width": (train.main, ["--set", f"optim.lr={FULL}e-3", *w], ["optim.lr", "ASCII digits"]),
      "mesh-full-width": (inspect.main, ["--mesh", f"dp={FULL}"], [f"dp={FULL}", "ASCII digits"]),
      "mesh-arabic-indic": (inspect.main, ["--mesh", "dp=\u0662"], ["dp=\u0662", "ASCII digits"]),
      "prompt-ids-full-width": (generate.main, [*gen, "--prompt-ids", f"1,{FULL}"], [f"item '{FULL}'", "ASCII"]),
      "max-new-tokens-full-width": (generate.main, [*gen, "--prompt-ids", "1", "--max-new-tokens", FULL],
                                    ["--max-new-tokens", "ASCII digits"]),
      "profile-steps-full-width": (train.main, ["--set", f"run.profile_steps={FULL}", *w], ["run.profile_steps"]),
      "max-shard-full-width": (hf_command.main, [*export, "--max-shard-gb", FULL], ["--max-shard-gb", "ASCII"]),
      # steps that are no step
      "export-step-negative": (hf_command.main, [*export, "--step", "-1"], ["--step -1", ">= 0"]),
      "generate-step-negative": (generate.main, [*gen, "--prompt-ids", "1", "--step", "-1"], ["--step -1"]),
  }


SILENT = sorted(_silent_cases(__import__("pathlib").Path("/nonexistent")))


@pytest.mark.parametrize("case", SILENT)
def test_what_was_accepted_silently_is_one_line_exit_2(case, tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the XLA flag verdicts: a probe of their own
  monkeypatch.chdir(tmp_path)
  main, argv, words = _silent_cases(tmp_path)[case]
  one_line_exit_2(capsys, main, argv, *words)
  assert not {"run", "out", "runs"} & {p.name for p in tmp_path.iterdir()}


def test_equal_duplicates_pass_and_a_later_layer_overrides(tmp_path):
  """Given twice with one value is no conflict; --set over the file, and a bench variant over --set, override."""
  cfg = config.load("tiny", ["train.lr=1e-3", "optim.lr=0.001", "train.steps=7", "train.steps=7"])
  assert (cfg.optim.lr, cfg.train.steps) == (1e-3, 7)
  path = _toml(tmp_path, "[train]\nlr = 1e-3\nsteps = 5\n")
  assert config.load(path, ["optim.lr=2e-3"]).optim.lr == 2e-3
  assert config.load(path, ["train.lr=3e-3"]).optim.lr == 3e-3
  assert config.load("tiny", ["optim.lr=1e-3"], then=["optim.lr=5e-4"]).optim.lr == 5e-4
  with pytest.raises(UserError, match="both set optim.lr"):
    config.load("tiny", ["optim.lr=1e-3"], then=["optim.lr=5e-4", "train.lr=4e-4"])
  # one name twice: the later --set wins (a script's base arguments, then an override), under either spelling pair
  assert config.load("tiny", ["train.steps=3", "train.steps=4"]).train.steps == 4
  assert config.load("tiny", ["optim.lr=1e-3", "optim.lr=2e-3"]).optim.lr == 2e-3


def test_unknown_xla_flag_warns_and_runs_only_when_asked(tmp_path, capsys):
  from jaxtrain.parallel import xla_flags
  cache, env = tmp_path / "flags.json", {}
  known = "--xla_gpu_enable_latency_hiding_scheduler=true"
  flags = f"--xla_jaxtrain_no_such_flag=1 {known}"
  with pytest.raises(UserError, match="--xla_jaxtrain_no_such_flag=1"):
    xla_flags.apply("none", flags, environ=env, cache=cache)
  assert env == {}
  assert xla_flags.apply("none", flags, environ=env, cache=cache, unknown="warn") == [known]
  assert "dropping XLA flag(s) this jaxlib does not know: --xla_jaxtrain_no_such_flag=1" in capsys.readouterr().err
  assert config.load("tiny", ["run.xla_flags_unknown=warn"]).run.xla_flags_unknown == "warn"
  assert not config.all_keys()["run.xla_flags_unknown"].metadata["math"]


# -- the one integer and list reading, checked directly --------------------------------------------------------------

@pytest.mark.parametrize("text, value", [("7", 7), (" 7 ", 7), ("-1", -1), ("+3", 3), ("1_000", 1000)])
def test_integers_in_ascii_digits_read_as_int_does(text, value):
  from jaxtrain.core import parse
  assert parse.integer(text) == value == int(text)


@pytest.mark.parametrize("text", ["--1", "1e3", "1.5", "", "_1", "1__0", FULL, "1" + FULL, "\u0662", "0x10"])
def test_what_is_no_ascii_integer_is_refused(text):
  from jaxtrain.core import parse
  with pytest.raises(ValueError):
    parse.integer(text)


def test_prompt_ids_with_spaces_read_as_the_ids():
  from jaxtrain.core import parse
  assert parse.int_items(" 1", "--prompt-ids") == [1]
  assert parse.int_items("1, 2 ,3", "--prompt-ids") == [1, 2, 3]
  assert parse.items("", "--allow-mismatch") == []


@pytest.mark.parametrize("spec, words", [("dp=\uff18", ["ASCII digits"]), ("dp=1,,tp=2", ["empty"]),
                                         ("dcn.dp=\uff12,dp=4", ["ASCII digits"]), ("dp=--1", ["dp=--1"])])
def test_mesh_parser_refuses_what_is_no_size(spec, words):
  with pytest.raises(UserError) as e:
    mesh_lib.parse_full(spec)
  for w in words:
    assert w in str(e.value)


def test_coordinator_port_in_ascii_digits():
  from jaxtrain.parallel import distributed
  with pytest.raises(UserError, match="HOST:PORT"):
    distributed.cluster_from("host:\uff18\uff10", 1, 0)
  assert distributed.cluster_from("host:80", 1, 0).coordinator == "host:80"


def test_bench_compare_variants_refuse_empty_items():
  from jaxtrain.analysis import compare
  with pytest.raises(UserError, match="empty"):
    compare.parse(["a:optim.lr=1e-3,,train.steps=2"])
  assert compare.parse(["a: optim.lr=1e-3 , train.steps=2"]) == [("a", ["optim.lr=1e-3", "train.steps=2"])]


# -- a path that cannot be used (issue 54): one line naming it and the problem, exit 2, in every command ------------

LONG = "x" * 300  # one name over every common filesystem's limit (255 bytes): ENAMETOOLONG


def _long_path_cases(tmp):
  from jaxtrain import goodput
  from jaxtrain.data import __main__ as data
  from jaxtrain.launch import __main__ as launch
  long, w = str(tmp / LONG), ["--workdir", str(tmp / "run")]
  return {
      "train-workdir": (train.main, ["--workdir", f"{long}/w"]),
      "train-resume-from": (train.main, [*w, "--resume-from", f"{long}/c"]),
      "data-prepare-output": (data.main, ["prepare", "--input", str(tmp / "in.jsonl"), "--output", f"{long}/o"]),
      "data-show": (data.main, ["show", f"{long}/a"]),
      "goodput": (goodput.main, [long]),
      "generate": (generate.main, ["--workdir", long, "--prompt", "hi"]),
      "hf-import": (hf_command.main, ["import", long, *w]),
      "hf-export-out": (hf_command.main, ["export", *w, "--out", f"{long}/o"]),
      "hf-export-workdir": (hf_command.main, ["export", "--workdir", long, "--out", str(tmp / "o")]),
      "bench-out": (bench.main, ["--out", f"{long}/b.json"]),
      "inspect-config": (inspect.main, ["--config", f"{long}/c.toml"]),
      "launch": (launch.main, ["--", "--workdir", f"{long}/w"]),
  }


@pytest.mark.parametrize("case", sorted(_long_path_cases(__import__("pathlib").Path("."))))
def test_a_name_longer_than_the_filesystem_allows_is_one_line_in_every_command(case, tmp_path, capsys):
  main, argv = _long_path_cases(tmp_path)[case]
  line = one_line_exit_2(capsys, main, argv, f"{tmp_path / LONG}", "file name too long", "300 bytes")
  assert not (tmp_path / "run").exists() and not (tmp_path / "o").exists(), line  # nothing written


def _path_errors(tmp):
  """A real OSError of each kind a path the user gave can meet (root reads any file: EACCES is made by hand)."""
  import errno
  import os
  (tmp / "a-file").write_text("")
  (tmp / "loop").symlink_to("loop")
  made = {errno.EACCES: OSError(errno.EACCES, os.strerror(errno.EACCES), str(tmp / "locked"))}
  for code, op in ((errno.ENAMETOOLONG, lambda: os.stat(tmp / LONG)), (errno.ENOTDIR, lambda: open(tmp / "a-file/x")),
                   (errno.ELOOP, lambda: open(tmp / "loop")), (errno.EISDIR, lambda: open(tmp))):
    try:
      op()
    except OSError as e:
      assert e.errno == code, e
      made[code] = e
  return made


@pytest.mark.parametrize("code", ["ENAMETOOLONG", "ENOTDIR", "ELOOP", "EISDIR", "EACCES"])
def test_the_shared_epilogue_makes_every_path_error_one_line(code, tmp_path, capsys):
  import errno
  import os

  from jaxtrain import cli
  from jaxtrain.core.errors import path_error
  err = _path_errors(tmp_path)[getattr(errno, code)]

  def body(set_prog):
    raise err
  line = one_line_exit_2(capsys, lambda argv: cli.main("jaxtrain.x", body), [], "jaxtrain.x: error: ",
                         os.fsdecode(err.filename), os.strerror(err.errno).lower())
  if code == "ENOTDIR":
    assert line.endswith(f"({tmp_path / 'a-file'} is not a directory)"), line
  # an I/O fault on a path stays a failure (a traceback, exit 1) that the supervisor restarts; exit 2 it would not
  assert path_error(OSError(errno.EIO, "Input/output error", str(tmp_path))) is None
