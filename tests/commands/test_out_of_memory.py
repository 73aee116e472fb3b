"""A device out-of-memory at run time (XLA's RESOURCE_EXHAUSTED; XLA:CPU hardly ever runs out, so the tests raise
JAX's runtime error where the device would) is one line, exit 2, in every command that runs a model: train and bench
give the memory bill's figure (computed here from the same config) and what to change, a bench baseline that does not
fit is named, generate and hf say what they can change. Any other runtime error stays as it is."""

import jax
import pytest

from jaxtrain import cli, generate, hf as hf_command, train
from jaxtrain.analysis import memory, speed
from jaxtrain.core import config
from jaxtrain.interop import decode, hf as hf_lib, hf_export
from jaxtrain.run import faults, step
from tests import hf_models as H
from tests.helpers import mesh_of

XLA_OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 30437326848 bytes."
SETS = ["train.batch_size=8", "train.seq_len=32"]
TINY = [a for s in SETS for a in ("--set", s)]


def _oom(message=XLA_OOM):
  def raising(*_, **__):
    raise jax.errors.JaxRuntimeError(message)
  return raising


def _one_line(capsys, prog: str) -> str:
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"{prog}: error: device out of memory ("), err
  return err[0]


def _billed(spec: str) -> str:
  setup = step.Setup(config.load("tiny", SETS), mesh_of(spec))
  return memory.human(memory.bill(setup, memory.grouped(memory.param_rows(setup)), 0.0).total)


@pytest.mark.slow  # compiles a step
@pytest.mark.parametrize("message", [XLA_OOM, "Out of memory allocating 1048576 bytes for a buffer"])
def test_train_step_out_of_memory_is_one_line_with_the_bill(message, tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(faults, "slow_point", lambda s: _oom(message)() if s == 1 else None)  # the second step
  with pytest.raises(SystemExit) as e:
    train.main(["--workdir", str(tmp_path / "w"), "--mesh", "fsdp=8", "--steps", "3", *TINY])
  assert e.value.code == 2
  line = _one_line(capsys, "jaxtrain")
  assert message in line and f"the memory bill counted {_billed('fsdp=8')} per device" in line, line
  assert "train.batch_size" in line and "model.remat=full" in line, line


def test_any_other_runtime_error_is_left_as_it_is(tmp_path, monkeypatch):
  monkeypatch.setattr(train.cli, "start", _oom("INTERNAL: an unrelated runtime failure"))
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
    train.main(["--workdir", str(tmp_path / "w"), "--mesh", "fsdp=8", "--steps", "1"])


def _bench(baselines):
  """bench's work on one device (bench.main asks for a one-device process with a baseline), under the commands'
  epilogue as bench.main runs it."""
  cfg = config.load("tiny", SETS)
  return cli.main("jaxtrain.bench", lambda _: speed.run(cfg, mesh_of("fsdp=1"), "tiny", steps=1, warmup=1,
                                                         baselines=baselines, rounds=1, measure=False))


@pytest.mark.slow  # compiles a step
def test_bench_baseline_that_does_not_fit_is_named(monkeypatch, capsys):
  made = speed.minimal_side

  def minimal_oom(*args):
    side = made(*args)
    side.step = _oom()  # its first (warm-up) step runs out
    return side
  monkeypatch.setattr(speed, "minimal_side", minimal_oom)
  with pytest.raises(SystemExit) as e:
    _bench(["minimal"])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("jaxtrain.bench: error: --baseline minimal does not fit"), err
  assert XLA_OOM in err[0] and "train.batch_size" in err[0], err


@pytest.mark.slow  # compiles a step
def test_bench_step_out_of_memory_gives_the_bill(monkeypatch, capsys):
  monkeypatch.setattr(speed, "time_steps", _oom())
  with pytest.raises(SystemExit) as e:
    _bench([])
  assert e.value.code == 2
  line = _one_line(capsys, "jaxtrain.bench")
  assert f"the memory bill counted {_billed('fsdp=1')} per device" in line, line


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  d = tmp_path_factory.mktemp("oom")
  H.llama(d / "hf", vocab=320)
  H.imported(d / "hf", d / "w")
  return d


@pytest.mark.parametrize("command", ["generate", "hf import", "hf export"])
def test_generate_and_hf_out_of_memory_is_one_line(command, imported, tmp_path, monkeypatch, capsys):
  if command == "generate":
    monkeypatch.setattr(decode, "from_checkpoint", _oom())
    main, argv = generate.main, ["--workdir", str(imported / "w"), "--prompt-ids", "1,2,3", "--mesh", "fsdp=8"]
  elif command == "hf import":
    monkeypatch.setattr(hf_lib, "run_import", _oom())
    main, argv = hf_command.main, ["import", str(imported / "hf"), "--workdir", str(tmp_path / "w"), "--mesh", "fsdp=8"]
  else:
    monkeypatch.setattr(hf_export, "run_export", _oom())
    main, argv = hf_command.main, ["export", "--workdir", str(imported / "w"), "--out", str(tmp_path / "out"),
                                   "--mesh", "fsdp=8"]
  with pytest.raises(SystemExit) as e:
    main(argv)
  assert e.value.code == 2
  line = _one_line(capsys, f"jaxtrain.{command}")
  assert XLA_OOM in line and "--mesh fsdp=N" in line and "memory bill" not in line, line
