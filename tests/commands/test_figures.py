"""Figures that must not mislead (issue 38): a step's time in metrics.jsonl, FP8 on the console, inspect's
gather text and ZeRO table, bench's config name and --compare shapes."""

import json
import re
import statistics
import sys
import time
from pathlib import Path

import pytest

from jaxtrain.core import config
from jaxtrain.run import loop
from tests.helpers import mesh_of

REPO = Path(__file__).resolve().parents[2]
SMALL = ["model.n_layers=1", "train.batch_size=4", "train.seq_len=32", "data.workers=0", "run.log_every=1000"]
SLOW_S = 2.0  # a one-time host cost, far above the small step's time


def _slow_tensorboardx(tmp_path, monkeypatch, request):
  """A tensorboardX whose import takes SLOW_S, as the real one takes seconds where it imports torch."""
  pkg = tmp_path / "fake_tb" / "tensorboardX"
  pkg.mkdir(parents=True)
  pkg.joinpath("__init__.py").write_text(f"import time\ntime.sleep({SLOW_S})\n")
  pkg.joinpath("proto").mkdir()
  stub = "  def __init__(self, *args, **kwargs): pass\n"
  pkg.joinpath("proto", "__init__.py").write_text("")
  pkg.joinpath("proto", "event_pb2.py").write_text(f"class Event:\n{stub}")
  pkg.joinpath("proto", "summary_pb2.py").write_text(f"class Summary:\n  class Value:\n  {stub}{stub}")
  pkg.joinpath("event_file_writer.py").write_text(
      f"class EventsWriter:\n{stub}  def write_event(self, event): pass\n  def flush(self): pass\n"
      "  def close(self): pass\n")
  monkeypatch.syspath_prepend(str(pkg.parent))
  # Every tensorboardX module the run imports is the fake's, submodules included; monkeypatch would only undo the
  # names it saw, so the fake's submodules would outlive the test and break the real package's later imports.
  _is_tb = lambda name: name == "tensorboardX" or name.startswith("tensorboardX.")
  real = {name: mod for name, mod in sys.modules.items() if _is_tb(name)}
  for name in real:
    del sys.modules[name]

  def restore():
    for name in [n for n in sys.modules if _is_tb(n)]:
      del sys.modules[name]
    sys.modules.update(real)
  request.addfinalizer(restore)


def _slow_eval(monkeypatch):
  """An eval whose host side takes SLOW_S at each call (as the first eval's set-up did)."""
  real = loop.Evaluator.__call__

  def slow(self, params):
    time.sleep(SLOW_S)
    return real(self, params)
  monkeypatch.setattr(loop.Evaluator, "__call__", slow)


@pytest.mark.slow
@pytest.mark.parametrize("case,sets", [
    ("eval every 2 steps", ["train.steps=5", "train.eval_interval=2", "run.tensorboard=false"]),
    ("eval at a checkpoint step", ["train.steps=5", "train.eval_interval=2", "checkpoint.interval=2",
                                   "run.tensorboard=false"]),
    ("eval at the last step", ["train.steps=4", "train.eval_interval=4", "run.tensorboard=false"]),
    ("tensorboard's first write", ["train.steps=5", "run.tensorboard=true"]),
])
def test_a_step_time_is_the_training_steps_own(case, sets, tmp_path, monkeypatch, request):
  """One-time host work (the eval, TensorBoard's import) is no step's time: every step_time_s stays near the
  median step (independent reference: the steps without that work), none absorbs it, none is ~0."""
  if "eval" in case:
    _slow_eval(monkeypatch)
    sets = [*sets, "data.eval_fraction=0.05", "data.eval_batches=1"]
  else:
    _slow_tensorboardx(tmp_path, monkeypatch, request)
  cfg = config.load("tiny", [*SMALL, *sets])
  loop.run(cfg, mesh_of("dp=1"), tmp_path / "w", "tiny")
  records = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(1, cfg.train.steps + 1))
  times = [r["step_time_s"] for r in records]
  median = statistics.median(times)
  assert median < SLOW_S / 4, times  # the reference: the small step itself
  assert max(times) < SLOW_S / 2, f"{case}: a step absorbed the {SLOW_S}s of one-time work: {times}"
  for r in records:
    assert r["step_time_s"] > median / 50, f"{case}: step {r['step']} reports ~0: {times}"
    assert r["tokens_per_sec"] == pytest.approx(r["tokens"] / r["step_time_s"])
  if "eval" in case:
    assert [("eval_loss" in r) for r in records] == [r["step"] % cfg.train.eval_interval == 0 for r in records]


class _StartedUp(Exception):
  """Raised where the run would look for its checkpoints: everything after is not about the start-up lines."""


@pytest.mark.parametrize("spec,sets,says", [
    ("dp=1", ["model.fp8=tensorwise"], "FP8 projections (model.fp8=tensorwise)"),
    ("dp=2,tp=2", ["model.fp8=tensorwise"], "FP8 projections (model.fp8=tensorwise)"),
    ("dp=2", ["model.fp8=tensorwise", "model.dtype=float32"], "FP8 projections (model.fp8=tensorwise)"),
    ("dp=2", ["model.fp8=none"], None),
])
def test_an_fp8_run_says_fp8_in_its_start_up_lines(spec, sets, says, tmp_path, monkeypatch, capsys):
  """The run's own header and its plan line name FP8 (the words inspect and bench use), and only when it is on."""
  from jaxtrain.run import checkpoint

  def stop(*a, **k):
    raise _StartedUp
  monkeypatch.setattr(checkpoint, "resume_point", stop)
  cfg = config.load("tiny", [*SMALL, *sets])
  with pytest.raises(_StartedUp):
    loop.run(cfg, mesh_of(spec), tmp_path / "w", "tiny")
  header, plan_line = capsys.readouterr().out.splitlines()[:2]
  assert header.startswith("jaxtrain: tiny (") and plan_line.startswith("attention: ")
  assert f"compute {cfg.model.dtype}" in header
  for line in (header, plan_line):
    assert (says in line) if says else ("FP8" not in line and "model.fp8" not in line), line


def _inspect(argv, capsys) -> str:
  from jaxtrain import inspect
  assert inspect.main(argv) == 0
  return capsys.readouterr().out


# (mesh, the gather the bill's text must name: hand-derived from sharding.RULES, where `embed` splits over fsdp and
# expert and nothing of a weight over data or tensor)
# (in-process inspect sees the 8 simulated devices: each mesh uses all of them)
GATHERS = [("dp=8", None), ("tp=8", None), ("dp=2,tp=4", None), ("sp=8", None), ("fsdp=8", "fsdp=8"),
           ("fsdp=2,tp=4", "fsdp=2"), ("dp=2,fsdp=4", "fsdp=4"), ("ep=8", "expert=8"),
           ("fsdp=2,ep=4", "fsdp=2 x expert=4")]


@pytest.mark.parametrize("spec,over", GATHERS, ids=[g[0] for g in GATHERS])
def test_inspect_names_the_axes_that_really_gather(spec, over, capsys):
  """'gathered over fsdp' only where fsdp splits the weights: the bill's notes name the axes that gather them, or
  say that nothing is gathered."""
  out = _inspect(["--mesh", spec], capsys)
  lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith(("  gathered_weights", "  relaid_stacks"))}
  named = {m for ln in lines.values() for m in re.findall(r"gathered over ([\w=]+(?: x [\w=]+)*)", ln)}
  assert named == ({over} if over else set()), lines
  if over is None:
    assert "not gathered" in lines["gathered_weights"] and "fsdp" not in out.split("Communication")[0], out


# (mesh, zero stage, warnings expected at --warn-replicated 1KiB: every float32 weight of tiny has a dimension that
# data=8 divides, so ZeRO leaves none of them replicated; without ZeRO on pure data parallelism all 9 weights are)
ZERO = [("dp=8", 2, 0), ("dp=8", 1, 0), ("dp=8", 0, 9), ("dp=4,fsdp=2", 2, 0), ("dp=2,tp=4", 1, 0),
        ("dp=2,sp=4", 0, 9), ("dp=2,sp=4", 2, 0)]


@pytest.mark.parametrize("spec,stage,warned", ZERO, ids=[f"{z[0]}-zero{z[1]}" for z in ZERO])
def test_inspect_parameter_table_uses_the_bills_zero_layout(spec, stage, warned, capsys):
  """The parameter table and its replication warnings show the master as the bill counts it: the table's bytes per
  device add up to the bill's float32 master (from the train state's own shardings), ZeRO's split included."""
  rep = json.loads(_inspect(["--mesh", spec, "--set", f"optim.zero_stage={stage}", "--warn-replicated", "1KiB",
                             "--json"], capsys))
  items = rep["memory"]["items"]
  master = items["master"] if stage else items["params"]  # zero-0: the params are the master
  assert rep["param_bytes_per_device"] == master
  assert sum(p["bytes"] * p["count"] for p in rep["params"]) == master
  assert len(rep["warnings"]) == warned, rep["warnings"]
  data = dict(kv.split("=") for kv in rep["mesh"].split(","))["data"]
  split = [p for p in rep["params"] if any("data" in (e if isinstance(e, list) else [e]) for e in p["spec"])]
  assert bool(split) == (stage > 0), (data, split)
  text = _inspect(["--mesh", spec, "--set", f"optim.zero_stage={stage}"], capsys)
  assert f"zero-{stage}" in text.splitlines()[2]  # the table's heading names the layout it shows


@pytest.mark.parametrize("baseline", ["minimal", "none"])
@pytest.mark.parametrize("config_arg,name", [("tiny", "tiny"), ("configs/tiny.toml", "tiny")])
def test_bench_names_the_config_it_ran_and_the_baseline_apart(baseline, config_arg, name, tmp_path, monkeypatch,
                                                              capsys):
  """`--baseline minimal` once made the report's config "minimal": the config bench runs (what it hands the timer,
  and so what the JSON and the table say) is --config's, the baselines a field of their own."""
  from jaxtrain import bench
  from jaxtrain.analysis import speed
  monkeypatch.chdir(REPO)  # configs/tiny.toml, relative to the checkout
  seen = {}

  def timer(cfg, mesh, config_name, *, baselines, **kw):  # the timing itself is tests/commands/test_bench.py's
    seen.update(config=config_name, baselines=baselines, layers=cfg.model.n_layers)
    return {"config": config_name, "baselines": baselines}
  monkeypatch.setattr(speed, "run", timer)
  real_start = bench.cli.start  # the baselines run on one device; this process holds 8 simulated ones

  def start(args, prog, **kw):
    started = real_start(args, prog, mesh=False, **kw)
    started.mesh = mesh_of("dp=1")
    return started
  monkeypatch.setattr(bench.cli, "start", start)
  monkeypatch.setattr(speed, "table", lambda rep: f"table of {rep['config']}")
  out = tmp_path / "b.json"
  assert bench.main(["--config", config_arg, "--mesh", "fsdp=1", "--baseline", baseline, "--out", str(out)]) == 0
  assert seen == {"config": name, "baselines": [] if baseline == "none" else [baseline], "layers": 2}
  assert json.loads(out.read_text()) == {"config": name, "baselines": seen["baselines"]}
  assert f"table of {name}" in capsys.readouterr().out


COMPARES = [  # (--set of the base, --compare variants, the shapes the error names; None: the shapes agree)
    ([], ["a:train.seq_len=64", "b:train.seq_len=32"], ("16 x 64", "16 x 32")),
    ([], ["a:train.batch_size=8", "b:train.batch_size=16"], ("8 x 128", "16 x 128")),
    (["train.seq_len=64"], ["a:model.remat=full", "b:train.batch_size=8,train.seq_len=32"], ("16 x 64", "8 x 32")),
    ([], ["a:model.remat=none", "b:model.remat=full", "c:train.seq_len=64"], ("16 x 128", "16 x 64")),
    ([], ["a:train.microbatches=2", "b:model.remat=full"], None),
]


@pytest.mark.parametrize("base,variants,shapes", COMPARES)
def test_bench_compare_refuses_variants_of_other_shapes(base, variants, shapes, tmp_path, capsys):
  """Variants are timed on the same batches: another batch shape is one line naming both shapes, exit 2, no
  traceback and no file; the same shape (other microbatches, remat) passes the check."""
  from jaxtrain import bench
  args = bench.parse_args(["--set", *base] if base else [])
  if shapes is None:
    bench._check_same_shape(args, [(n, [s]) for n, _, s in (v.partition(":") for v in variants)])
    return
  out = tmp_path / "b.json"
  argv = ["--mesh", "dp=8", "--steps", "1", "--warmup", "0", "--rounds", "1", "--out", str(out)]
  for s in base:
    argv += ["--set", s]
  for v in variants:
    argv += ["--compare", v]
  with pytest.raises(SystemExit) as e:
    bench.main(argv)
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and len(err.splitlines()) == 1, err
  assert "Traceback" not in err and all(s in err for s in shapes), err
  assert not out.exists()


@pytest.mark.slow  # two compiles on eight simulated devices
def test_bench_compare_times_each_variant_on_its_own_mesh(tmp_path, capsys):
  """NAME@MESH: a variant on its own mesh of the bench's devices (layouts compared in alternating rounds): data=8
  holds the whole state on every device, fsdp=8 an eighth, so XLA's per-device arguments differ by about 8x; a mesh
  over another device count is one line, exit 2, no file."""
  import json
  from jaxtrain import bench
  out = tmp_path / "b.json"
  argv = ["--mesh", "fsdp=8", "--steps", "1", "--warmup", "0", "--rounds", "1", "--out", str(out),
          "--set", "train.batch_size=8", "--set", "train.seq_len=32"]
  assert bench.main([*argv, "--compare", "f:model.remat=none", "--compare", "d@data=8:model.remat=none"]) == 0
  rep = json.loads(out.read_text())["variants"]
  assert set(rep) == {"f", "d"} and rep["d"]["mesh"] == "data=8" and rep["f"]["mesh"] == "fsdp=8"
  args_f, args_d = (rep[n]["compiled_memory_per_device"]["argument_bytes"] for n in ("f", "d"))
  assert args_d > 4 * args_f, (args_d, args_f)
  assert len(rep["d"]["round_medians_s"]) == 1 and "d (data=8)" in capsys.readouterr().out
  out.unlink()
  with pytest.raises(SystemExit) as e:
    bench.main([*argv, "--compare", "a@fsdp=4:", "--compare", "b:model.remat=full"])
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and len(err.splitlines()) == 1 and "spans 4 devices" in err, err
  assert not out.exists()
