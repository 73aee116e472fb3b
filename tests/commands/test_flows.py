"""The documented flows across commands, through each command's main(argv) as a user types
them: relative paths from import to export, dotted preset names, the generation bound, a
multi-host mesh inspected from one machine, and bad input as one line."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("transformers")

from jaxtrain import bench, generate, hf as hf_command, inspect, train  # noqa: E402
from jaxtrain.data import __main__ as data_command  # noqa: E402
from jaxtrain.run import loop, runs  # noqa: E402
from tests import hf_models as H  # noqa: E402
from tests.helpers import mesh_of  # noqa: E402

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  """A tiny Llama imported into a workdir (step 0); its HF directory beside it."""
  d = tmp_path_factory.mktemp("flows")
  H.llama(d / "hf", vocab=320)
  H.imported(d / "hf", d / "w")
  return d


# The README's fine-tuning flow as typed, in one process of one device, from the directory `hf` lies in.
FLOW = """
import sys
from jaxtrain import generate, hf, train
sets = ["--set", "train.batch_size=4", "--set", "train.seq_len=32", "--set", "data.workers=0", "--set", "optim.lr=1e-2",
        "--set", "optim.warmup_steps=0"]
for main, argv in ((hf.main, ["import", "hf", "--workdir", "w", "--name", "m", "--set", "model.dtype=float32"]),
                   (train.main, ["--config", "w/m.toml", "--workdir", "w", "--steps", "2", *sets]),
                   (hf.main, ["export", "--workdir", "w", "--out", "out", "--dtype", "float32"]),
                   (generate.main, ["--workdir", "w", "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--ignore-eos"])):
  assert main(argv) == 0, argv
"""


def test_fine_tuning_flow_with_relative_paths(tmp_path):
  """import -> train 2 steps -> export -> generate, every path relative to the working directory:
  the export loads in transformers as the trained function, and generates what it generates."""
  import subprocess
  import sys

  import torch
  import transformers
  from tests.helpers import clean_env
  start = H.llama(tmp_path / "hf", vocab=320)
  r = subprocess.run([sys.executable, "-c", FLOW], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert runs.locate(tmp_path / "w", None).name == "2"
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
  _, model, _ = H.load(tmp_path / "w", "fsdp=1")
  ids = np.random.default_rng(1).integers(0, 320, (2, 24))
  assert H.rel_err(H.jax_logits(model, ids), H.torch_logits(back, ids)) < 1e-5
  assert H.rel_err(H.torch_logits(start, ids), H.torch_logits(back, ids)) > 1e-3  # the 2 steps changed it
  ref = [5, 6, 7]
  for _ in range(4):  # greedy, by hand
    ref.append(int(H.torch_logits(back, [ref])[0, -1].argmax()))
  assert r.stdout.strip().splitlines()[-1] == ",".join(map(str, ref[3:]))


def test_dotted_presets_get_separate_workdirs_and_full_names(tmp_path, monkeypatch, capsys):
  """llama3.1-8b and llama3.2-1b train into runs/llama3.1-8b and runs/llama3.2-1b (not both
  into runs/llama3) under their full names, and inspect's header names the preset in full."""
  seen = []
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(loop, "run", lambda cfg, mesh, workdir, name, **kw: seen.append((workdir, name)) or loop.Summary())
  for name in ("llama3.1-8b", "llama3.2-1b"):
    train.main(["--config", name, "--mesh", "fsdp=8"])
  assert seen == [(tmp_path / "runs" / n, n) for n in ("llama3.1-8b", "llama3.2-1b")]
  capsys.readouterr()
  inspect.main(["--config", "llama3.2-1b", "--mesh", "fsdp=8"])
  assert "llama3.2-1b" in capsys.readouterr().out.splitlines()[0]


def test_generation_is_bounded_before_anything_is_allocated(imported, monkeypatch, capsys):
  """A request beyond the model's context (max_position_embeddings = 64) or beyond what the
  bill lets fit is one line: no parameter is restored, no cache is built."""
  from jaxtrain.analysis import fit
  from jaxtrain.core.errors import UserError
  from jaxtrain.interop import decode

  def allocates(*a, **k):
    raise AssertionError("allocated before refusing")
  monkeypatch.setattr(runs, "restore_params", allocates)
  with pytest.raises(SystemExit) as e:
    generate.main(["--workdir", str(imported / "w"), "--prompt-ids", "1,2,3", "--max-new-tokens", "100000000"])
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and len(err) == 1, err
  assert "longest prompt (3 tokens) plus the new tokens must fit the model's context of 64 positions" in err[0]
  # within the context but not within memory: refused before the cache exists
  monkeypatch.undo()
  cfg, model, params = H.load(imported / "w", "fsdp=8")
  monkeypatch.setattr(decode, "_functions", allocates)
  weights = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))
  # one row of 3 + 37 slots per device: 2 layers x (k, v) x 40 x 2 kv heads x 8 wide x float32, segment ids, start
  cache = 2 * 2 * 40 * 2 * 8 * 4 + 40 * 4 + 4
  for have, refused in ((weights + cache - 1, UserError), (weights + cache, AssertionError)):
    monkeypatch.setattr(fit, "capacity", lambda mesh: (have, "test"))  # noqa: B023
    with pytest.raises(refused, match="KV cache per device" if refused is UserError else "allocated"):
      decode.generate(cfg, mesh_of("fsdp=8"), nnx.split(model)[0], params, [[1, 2, 3]] * 8, 37)


def _mesh_preset(tmp_path):
  p = tmp_path / "two-hosts.toml"
  p.write_text("[axes]\nfsdp = 4\nexpert = 2\n[dcn]\nfsdp = 2\n")
  return str(p)


def test_inspect_of_a_multi_host_mesh_simulates_the_hosts(tmp_path, capsys):
  inspect.main(["--config", "moe-tiny", "--mesh", _mesh_preset(tmp_path)])
  out = capsys.readouterr().out
  assert "moe-tiny" in out and "fsdp=4,expert=2" in out


ROOT = os.geteuid() == 0  # root writes into a read-only-mode directory: nothing to refuse


def _bad_inputs(d, tmp):
  """(command main, argv, words of the one line) for each mistake; `d` holds an imported run."""
  (tmp / "empty").mkdir(parents=True)
  (tmp / "a-file").write_text("x")
  (tmp / "binary").write_bytes(b"\xff\xfe\x00hello")
  (tmp / "ro").mkdir()
  os.chmod(tmp / "ro", 0o555)
  w, gen = str(d / "w"), ["--workdir", str(d / "w"), "--prompt-ids", "1"]
  return {
      "source-without-manifest": (train.main, ["--set", f"data.source={tmp / 'empty'}", "--workdir", str(tmp / "t")],
                                  ["has no manifest.json"]),
      "import-workdir-is-a-file": (hf_command.main, ["import", str(d / "hf"), "--workdir", str(tmp / "a-file")],
                                   ["a-file is not a directory"]),
      "import-workdir-read-only": (hf_command.main, ["import", str(d / "hf"), "--workdir", str(tmp / "ro" / "w")],
                                   ["is not writable"]),
      "import-name-escapes": (hf_command.main, ["import", str(d / "hf"), "--workdir", str(tmp / "n"),
                                                "--name", "../../escape"], ["must be a plain file name"]),
      "export-out-is-a-file": (hf_command.main, ["export", "--workdir", w, "--out", str(tmp / "a-file")],
                               ["a-file is not a directory"]),
      "export-out-read-only": (hf_command.main, ["export", "--workdir", w, "--out", str(tmp / "ro" / "o")],
                               ["is not writable"]),
      "prompts-file-binary": (generate.main, ["--workdir", w, "--prompts-file", str(tmp / "binary")],
                              ["not UTF-8 text"]),
      "temperature-nan": (generate.main, [*gen, "--temperature", "nan"], ["--temperature nan"]),
      "empty-prompt": (generate.main, ["--workdir", w, "--prompt", ""], ["--prompt ''"]),
      "full-width-resume": (train.main, ["--resume-from", "\uff11\uff10", "--workdir", str(tmp / "t")],
                            ["ASCII digits"]),
      "empty-workdir": (train.main, ["--workdir", ""], ["--workdir ''"]),
      "empty-generate-workdir": (generate.main, ["--workdir", "", "--prompt-ids", "1"], ["--workdir ''"]),
      "zero-device-memory": (inspect.main, ["--device-memory", "0"], ["--device-memory '0'"]),
      "negative-breakdown": (bench.main, ["--breakdown", "-2", "--workdir", str(tmp / "b")], ["--breakdown -2"]),
      "bos-token-with-bytes": (data_command.main, ["prepare", "--input", str(tmp / "a-file"), "--output",
                                                   str(tmp / "p"), "--bos-token", "<s>"], ["byte tokenizer"]),
  }


# Mesh sizes are checked in a process of its own: simulated devices are created once per process.
SUBPROCESS = {
    "mesh-too-big-for-an-int": ("jaxtrain.generate", ["--prompt-ids", "1", "--mesh", "dp=99999999999999999999"],
                                ["at most 4096 CPU devices"]),
    "mesh-batch-does-not-split": ("jaxtrain.train", ["--mesh", "dp=100000", "--workdir", "w"],
                                  ["divide over data*fsdp*expert=100000"]),
    "inspect-mesh-huge": ("jaxtrain.inspect", ["--mesh", "dp=100000"], ["divide over data*fsdp*expert=100000"]),
}
CASES = ["source-without-manifest", "import-workdir-is-a-file",
         pytest.param("import-workdir-read-only", marks=pytest.mark.skipif(ROOT, reason="root writes anywhere")),
         "import-name-escapes", "export-out-is-a-file",
         pytest.param("export-out-read-only", marks=pytest.mark.skipif(ROOT, reason="root writes anywhere")),
         "prompts-file-binary", "temperature-nan", "empty-prompt", "full-width-resume", "empty-workdir",
         "empty-generate-workdir", "zero-device-memory", "negative-breakdown", "bos-token-with-bytes", *SUBPROCESS]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, imported, tmp_path, monkeypatch, capsys, run_cli):
  """Exit 2, one line on stderr naming the value, no traceback; the imported run, the file given
  as an output and the working directory are left as they were."""
  monkeypatch.chdir(tmp_path)
  if case in SUBPROCESS:
    module, argv, words = SUBPROCESS[case]
    workdir = ["--workdir", str(imported / "w")] if module.endswith("generate") else []
    r = run_cli(module, *argv, *workdir, timeout=120)
    code, err = r.returncode, r.stderr
  else:
    main, argv, words = _bad_inputs(imported, tmp_path / "in")[case]
    before = sorted(p.relative_to(imported) for p in imported.rglob("*"))
    with pytest.raises(SystemExit) as e:
      main(argv)
    code, err = e.value.code, capsys.readouterr().err
    assert sorted(p.relative_to(imported) for p in imported.rglob("*")) == before
    assert not {"n", "o", "p", "b", "runs"} & {p.name for p in tmp_path.rglob("*")}, list(tmp_path.rglob("*"))
    assert (tmp_path / "in" / "a-file").read_text() == "x"
  lines = err.strip().splitlines()
  assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
  for word in words:
    assert word in lines[0], lines[0]
