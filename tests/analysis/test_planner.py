"""The planner (jaxtrain.analysis.planner, python -m jaxtrain.plan): every layout it lists can run and fits by the
bill, built again here from its mesh spec and overrides; what the bill or the config refuses is left out; the mesh
spans --gpus with tensor and expert inside a host; the winner's preset loads with --mesh; bad flags in one line."""

import itertools
import math
import shlex

import pytest

from jaxtrain.analysis import fit, gpu_compile, memory, planner
from jaxtrain.core import config
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.parallel import plan as plan_lib
from jaxtrain import data
from jaxtrain.run import step as step_lib

from tests.helpers import needs_plugin

H100 = 80 * 2**30
_ABSTRACTS = {}  # the abstract models of the configs here, traced once


def _rebuilt_bill(name, sets, layout, device="H100"):
  """The bill of a listed layout, from its own mesh spec and --set items, as inspect computes it."""
  cfg = config.load(name, [*sets, *layout.overrides()])
  mesh = gpu_compile.mesh(device, layout.mesh_spec()) if gpu_compile.plugin_installed() else mesh_lib.build(
      mesh_lib.parse_full(layout.mesh_spec())[0])
  segments = data.most_segments(cfg, cfg.train.steps)  # the data's rows, as inspect plans the attention for them
  setup = step_lib.Setup(cfg, mesh, segments=segments, abstracts=_ABSTRACTS)  # raises the config's one-line refusal
  b = memory.bill(setup, memory.grouped(memory.param_rows(setup)), 0.10,
                  plan=plan_lib.build(setup.cfg, mesh, device=device, segments=segments))
  return b.total


@pytest.mark.parametrize("name, sets, gpus, per_host", [
    pytest.param("tiny", ["train.batch_size=8"], 4, 2,  # dense, on two hosts of two: cross-host factors too
                 marks=pytest.mark.slow),  # 18 s
    ("moe-tiny", ["train.batch_size=8"], 2, 1),  # MoE: the expert axis across two hosts of one GPU
    pytest.param("deepseek-v3-tiny", ["train.batch_size=8", "train.seq_len=64"], 4, 2,  # MLA, dropless, dense first
                 marks=pytest.mark.slow),
])
def test_every_listed_layout_runs_fits_and_spans_the_gpus(name, sets, gpus, per_host):
  target = planner.Target("H100", gpus, per_host)
  out = planner.plan(name, sets, target, compile_top=0, progress=False)
  assert out.results, out.refused
  for r in out.results:
    axes, dcn = mesh_lib.parse_full(r.layout.mesh_spec())
    assert math.prod(axes.values()) == gpus
    inner = axes["tensor"] * axes["expert"] // dcn["expert"]
    assert per_host % inner == 0 and (dcn["expert"] == 1 or inner == per_host)  # expert crosses from a full host
    assert math.prod(dcn.values()) == gpus // per_host and all(axes[a] % k == 0 for a, k in dcn.items())
    assert dcn["tensor"] == 1
    total = _rebuilt_bill(name, sets, r.layout)
    assert total == r.bill and fit.verdict(total, H100)[0]
  steps = [r.step_s for r in out.results]
  assert steps == sorted(steps)
  if name != "tiny":
    assert any(r.layout.axes["expert"] > 1 for r in out.results)  # expert parallelism is among the layouts
  if name == "moe-tiny":  # and across hosts, its all-to-all at the network's bandwidth
    across = [r for r in out.results if dict(r.layout.dcn)["expert"] > 1]
    assert across
    setup = step_lib.Setup(config.load(name, [*sets, *across[0].layout.overrides()]),
                           gpu_compile.mesh("H100", across[0].layout.mesh_spec()) if gpu_compile.plugin_installed()
                           else mesh_lib.build(mesh_lib.parse_full(across[0].layout.mesh_spec())[0]))
    a2a = sum(v for k, v in planner.comms.moe_traffic(setup.cfg, setup.mesh)["expert"].items())
    assert across[0].estimate["exposed_s"] >= a2a / planner.DCN_BANDWIDTH > 0
    # the experts' three float32 weights (2 layers x 4 experts x 128 x 256 each) split over expert x fsdp (and
    # their hidden width over tensor)
    axes, m = across[0].layout.axes, setup.cfg.model
    experts = sum(r.bytes * r.count for r in memory.param_rows(setup) if "experts" in r.axes)
    assert experts == 3 * 4 * m.moe_layers() * 4 * 128 * 256 // (axes["expert"] * axes["fsdp"] * axes["tensor"])


def test_refused_layouts_are_pruned_with_their_line():
  """tiny has 2 layers: pipeline=2 with 2 virtual stages (interleaved, zbv, dualpipev) cannot split them evenly."""
  out = planner.plan("tiny", ["train.batch_size=8"], planner.Target("H100", 2, 2), compile_top=0, progress=False)
  assert any("must divide into pipeline=2 x pipeline.virtual_stages=2" in why for why in out.refused)
  piped = [r.layout for r in out.results if r.layout.axes["pipeline"] > 1]
  assert piped and all(l.virtual_stages == 1 for l in piped)
  assert {l.schedule for l in piped} == {"1f1b", "zb-h1"}


def test_a_layout_over_memory_is_pruned(monkeypatch):
  """With a device memory between the bills of fsdp=2 and data=2 (replicated state), data=2 without ZeRO is out."""
  sets = ["train.batch_size=8"]
  base = planner.Layout(tuple(dict(pipeline=1, data=2, fsdp=1, expert=1, sequence=1, tensor=1).items()),
                        tuple((a, 1) for a in mesh_lib.AXES))
  sharded = planner.Layout(tuple(dict(pipeline=1, data=1, fsdp=2, expert=1, sequence=1, tensor=1).items()), base.dcn)
  big, small = _rebuilt_bill("tiny", sets, base), _rebuilt_bill("tiny", sets, sharded)
  assert small < big
  monkeypatch.setitem(planner.devices.TABLE, "H100", planner.devices.TABLE["H100"].__class__(
      **{**planner.devices.TABLE["H100"].__dict__, "memory_bytes": (small + big) // 2}))
  out = planner.plan("tiny", sets, planner.Target("H100", 2, 2), compile_top=0, progress=False)
  listed = {r.layout for r in out.results}
  assert sharded in listed and base not in listed and out.over_memory > 0
  assert all(r.bill <= (small + big) // 2 for r in out.results)


def test_winner_preset_loads_as_the_mesh(tmp_path, capsys):
  from jaxtrain import plan as plan_cmd
  out_file = tmp_path / "best.toml"
  rc = plan_cmd.main(["--config", "tiny", "--gpus", "2", "--gpus-per-host", "1", "--compile-top", "0",
                      "--global-batch", "8", "--output", str(out_file)])
  text = capsys.readouterr().out
  assert rc == 0 and out_file.is_file()
  winner = text.split("winner: ", 1)[1].splitlines()[0]
  axes, dcn = mesh_lib.parse_full(str(out_file))
  assert mesh_lib.describe(axes) == winner.split(" | ")[0]
  assert math.prod(axes.values()) == 2 and math.prod(dcn.values()) == 2  # two hosts of one
  # the printed command runs as written: its --mesh and --set items load, and inspect takes them
  words = shlex.split(text.split("python -m jaxtrain.train ", 1)[1].splitlines()[0])
  sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
  assert words[words.index("--mesh") + 1] == str(out_file)
  cfg = config.load("tiny", sets)
  assert cfg.train.batch_size == 8 and f"remat {cfg.model.remat}" in winner
  from jaxtrain import inspect
  assert inspect.main(["--config", "tiny", "--mesh", str(out_file), "--device", "H100",
                       *[x for s in sets for x in ("--set", s)]]) == 0
  assert f"on mesh {mesh_lib.describe(axes)} (2 x" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["--gpus", "0"], "--gpus 0"),
    (["--gpus", "12", "--gpus-per-host", "8"], "--gpus-per-host 8"),
    (["--gpus", "8", "--device", "TPU v4"], "--device 'TPU v4'"),
    (["--gpus", "8", "--budget-min", "0"], "--budget-min 0"),
    (["--gpus", "8", "--global-batch", "-4"], "--global-batch -4"),
    (["--gpus", "8", "--set", "train.nope=1"], "train.nope"),
    (["--gpus", "8", "--output", "/nonexistent/dir/p.toml"], "--output"),
    (["--gpus", "4", "--device", "cpu", "--gpus-per-host", "2"], "--gpus-per-host 2"),
])
def test_bad_flags_stop_in_one_line(argv, words, capsys):
  from jaxtrain import plan as plan_cmd
  with pytest.raises(SystemExit) as e:
    plan_cmd.main(["--config", "tiny", "--compile-top", "0", *argv])
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and len(err.splitlines()) == 1 and words in err


@needs_plugin
@pytest.mark.slow
def test_the_best_are_compiled_and_ranked_first_within_the_budget():
  sets = ["train.batch_size=8", "model.dtype=bfloat16"]
  out = planner.plan("tiny", sets, planner.Target("H100", 2, 2), compile_top=2, progress=False)
  compiled = [r for r in out.results if r.compiled]
  assert len(compiled) == 2 and out.results[:2] == compiled
  assert all(0 < r.compiled["total"] <= H100 and r.compiled["step_s"] > 0 and r.compiled["calibrated"]
             for r in compiled)
  # a budget already spent by the pruning: nothing compiled, and the plan says so
  late = planner.plan("tiny", sets, planner.Target("H100", 2, 2), compile_top=2, budget_s=1e-3, progress=False)
  assert not any(r.compiled for r in late.results)
  assert any("time budget reached: 0 of 2" in n for n in late.compile_notes)


@pytest.mark.slow
def test_the_printed_command_trains(run_cli, tmp_path):
  """`plan` as a user runs it, then its printed train command with the written preset: one step on CPU devices."""
  p = run_cli("jaxtrain.plan", "--config", "tiny", "--gpus", "2", "--compile-top", "0", "--global-batch", "4")
  assert p.returncode == 0, p.stderr
  assert (tmp_path / "plan-tiny-2xh100.toml").is_file()
  command = shlex.split(p.stdout.split("python -m ", 1)[1].splitlines()[0])
  assert command[0] == "jaxtrain.train"
  t = run_cli(*command, "--steps", "1", "--workdir", "runs/planned")
  assert t.returncode == 0, t.stderr
  assert (tmp_path / "runs/planned/metrics.jsonl").is_file()


@pytest.mark.parametrize("name, seq_len", [("tiny", 128), ("tiny", 16384), ("moe-tiny", 128)])
def test_meshes_are_every_split_of_the_gpus_the_rules_allow(name, seq_len):
  """Against brute force: every assignment of sizes to the six axes with product 16 (two hosts of 8), tensor inside a
  host, expert only for MoE and dividing the experts, inside a host beside tensor or its whole rest of the host times
  the hosts, pipeline dividing the layers, sequence only from 8192 tokens per way (batch 16: a whole sequence a GPU)."""
  cfg = config.load(name, [f"train.seq_len={seq_len}"])
  got = {tuple(sizes.values()) for sizes, _ in planner.meshes(cfg, planner.Target("H100", 16, 8))}
  want = set()
  for sizes in itertools.product(*[(1, 2, 4, 8, 16)] * 6):  # every size divides 16
    s = dict(zip(("pipeline", "data", "fsdp", "expert", "sequence", "tensor"), sizes))
    if (math.prod(sizes) == 16 and 8 % s["tensor"] == 0
        and (8 % (s["tensor"] * s["expert"]) == 0 or s["tensor"] * s["expert"] == 16)
        and (s["expert"] == 1 or (cfg.model.moe_experts and cfg.model.moe_experts % s["expert"] == 0))
        and cfg.model.n_layers % s["pipeline"] == 0 and s["sequence"] * 8192 <= max(seq_len, 8192)):
      want.add(sizes)
  assert got == want
  assert any(s[4] > 1 for s in got) == (seq_len >= 16384) and any(s[3] > 1 for s in got) == (name == "moe-tiny")
  assert any(s[3] * s[5] == 16 for s in got) == (name == "moe-tiny")  # an expert axis across the two hosts


def test_a_short_batch_splits_its_sequences():
  """Fewer sequences than GPUs (DeepSeek-V3's 256 x 4096 on 512): a sequence axis up to the split that gives every
  GPU a part of one, though the sequences are short; with enough sequences, none."""
  cfg = config.load("tiny", ["train.batch_size=4"])
  got = {sizes["sequence"] for sizes, _ in planner.meshes(cfg, planner.Target("H100", 16, 8))}
  assert got == {1, 2, 4}
  cfg = config.load("tiny", ["train.batch_size=16"])
  assert {sizes["sequence"] for sizes, _ in planner.meshes(cfg, planner.Target("H100", 16, 8))} == {1}



def test_expert_weight_gathers_hide_under_compute_as_fsdp_ones_do():
  """moe-tiny on expert=2: the dense weights are stored split over expert and gathered per layer, as fsdp's are, so
  the bound hides those gathers and gradient reduce-scatters under the compute; the all-to-alls stay exposed."""
  from tests.helpers import mesh_of
  setup = step_lib.Setup(config.load("moe-tiny"), mesh_of("ep=2"))
  rows = memory.grouped(memory.param_rows(setup))
  layout = planner.Layout(tuple(dict(pipeline=1, data=1, fsdp=1, expert=2, sequence=1, tensor=1).items()),
                          tuple((a, 1) for a in mesh_lib.AXES))
  row = planner.devices.TABLE["H100"]
  est = planner.estimate(setup, rows, layout, row)
  parts = planner.comms.traffic(setup.cfg, setup.mesh, rows)["expert"]
  layerwise = ("param all-gather (fwd+bwd)", "grad reduce-scatter")
  hidden = sum(parts[k] for k in layerwise) / row.link_bandwidth
  rest = sum(v for k, v in parts.items() if k not in layerwise) / row.link_bandwidth
  assert hidden > 0 and rest > 0 and est["compute_s"] > 0
  assert est["exposed_s"] == pytest.approx(rest + max(0.0, hidden - est["compute_s"]))

@pytest.mark.slow  # an XLA:CPU compile
def test_cpu_plan_measures_this_host_compiles_with_xla_cpu_and_ranks():
  """--device cpu: the row is measured here (each simulated device 1/N of the host's RAM), every listed layout spans
  the N devices of the one host and fits by the bill of a CPU mesh built again here, the best is compiled with
  XLA:CPU (this process's devices) and ranked first, the rest by the analytic bound."""
  import os
  import jax
  sets = ["train.batch_size=4", "train.seq_len=64"]
  out = planner.plan("tiny", sets, planner.Target("cpu", 2, 2), compile_top=1, progress=False)
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  assert out.row.memory_bytes == ram // 2 and out.row.peak_bf16_flops > 0 and out.row.bandwidth > 0
  assert out.results and out.results[0].compiled and not any(r.compiled for r in out.results[1:])
  assert 0 < out.results[0].compiled["total"] and out.results[0].compiled["step_s"] > 0
  rest = [r.step_s for r in out.results[1:]]
  assert rest == sorted(rest)
  for r in out.results:
    axes, dcn = mesh_lib.parse_full(r.layout.mesh_spec())
    assert math.prod(axes.values()) == 2 and math.prod(dcn.values()) == 1
    cfg = config.load("tiny", [*sets, *r.layout.overrides()])
    mesh = mesh_lib.build(axes, jax.devices("cpu")[:2])  # the test process holds 8
    segments = data.most_segments(cfg, cfg.train.steps)
    setup = step_lib.Setup(cfg, mesh, segments=segments, abstracts=_ABSTRACTS)
    b = memory.bill(setup, memory.grouped(memory.param_rows(setup)), 0.10,
                    plan=plan_lib.build(setup.cfg, mesh, segments=segments))
    assert mesh.devices.flat[0].platform == "cpu" and b.total == r.bill
  assert "simulated on this host" in planner.render(out, 5)


@pytest.mark.slow  # an inspect report per layout checked
@pytest.mark.parametrize("sets", [
    ["train.batch_size=8", "model.lora_rank=4"],  # LoRA: the adapters trained, the base frozen (no master, no moments)
    ["train.batch_size=8", "optim.name=muon"],  # Muon: one moment for the matrices, its orthogonalization's work
])
def test_lora_and_muon_layouts_are_billed_as_inspect_bills_them(sets):
  """Each listed layout's bill is inspect's (analysis.report, the command's own path) for the same mesh and --set
  items, built afresh for that layout; ZeRO stages are among the layouts (their state sharding billed too)."""
  from jaxtrain.analysis import report
  out = planner.plan("tiny", sets, planner.Target("H100", 4, 2), compile_top=0, progress=False)
  assert out.results, out.refused
  assert {r.layout.zero_stage for r in out.results} == {0, 1, 2}
  for r in out.results[::4]:  # every fourth: each inspect report traces the model afresh
    cfg = config.load("tiny", [*sets, *r.layout.overrides()])
    mesh = report.target_mesh("H100", r.layout.mesh_spec(), False, None)[0]
    rep = report.report(cfg, mesh, "tiny", device="H100")
    assert rep["memory"]["total"] == r.bill, r.layout.label()
