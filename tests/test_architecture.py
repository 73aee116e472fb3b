"""The import graph of jaxtrain, read from the source with `ast` (every import, including the
ones inside functions): no import circles, commands are imported only by commands, and the
packages keep their layers. Each rule is also run on a small package with a known fault, so
that it is seen to fail."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jaxtrain"

# The command layer: what a user runs, and the start-up they share.
COMMANDS = {"jaxtrain.train", "jaxtrain.inspect", "jaxtrain.bench", "jaxtrain.debug", "jaxtrain.hf",
            "jaxtrain.generate", "jaxtrain.eval", "jaxtrain.data.__main__", "jaxtrain.launch.__main__", "jaxtrain.goodput",
            "jaxtrain.plan",
            "jaxtrain.cli"}

# Package -> the jaxtrain packages it may import (None: any package, but no command).
ALLOWED = {
    "core": {"core"},
    "model": {"core", "model"},  # plain math: parallelism reaches it through model.ops, installed from outside
    "parallel": {"core", "model", "parallel"},
    "run": None,
    "analysis": None,
    "data": None,
    "interop": None,
}


def module_names(root: pathlib.Path) -> dict[str, pathlib.Path]:
  """{dotted module name: file} for every .py file under the package directory `root`."""
  out = {}
  for path in sorted(root.rglob("*.py")):
    parts = (root.name, *path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


def _imported(node, module: str, is_package: bool, known) -> set[str]:
  """The known modules that one import statement in `module` loads by name."""
  if isinstance(node, ast.Import):
    targets = [alias.name for alias in node.names]
  else:
    if node.level:  # relative: from the module's package, one level up per extra dot
      base = module.split(".") if is_package else module.split(".")[:-1]
      base = base[:len(base) - (node.level - 1)]
      prefix = ".".join(base + ([node.module] if node.module else []))
    else:
      prefix = node.module
    # `from p import name`: the submodule p.name if there is one, else p itself
    targets = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in known else prefix for alias in node.names]
  out = set()
  for t in targets:
    parts = t.split(".")
    for n in range(len(parts), 0, -1):  # `import a.b.c` where only a.b is a module of ours: a.b
      if ".".join(parts[:n]) in known:
        out.add(".".join(parts[:n]))
        break
  return out


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
  """{module: modules of the same package tree it imports}, from every import statement
  anywhere in the file (module level, functions, branches)."""
  files = module_names(root)
  graph = {}
  for module, path in files.items():
    tree = ast.parse(path.read_text(), filename=str(path))
    edges = set()
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        edges |= _imported(node, module, path.name == "__init__.py", files)
    graph[module] = edges - {module}
  return graph


def circles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
  """Strongly connected components of more than one module (Tarjan), each as (its modules,
  one concrete cycle a -> b -> ... -> a through the first of them)."""
  index, low, on_stack, stack, sccs = {}, {}, set(), [], []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      scc = set()
      while True:
        w = stack.pop()
        on_stack.discard(w)
        scc.add(w)
        if w == v:
          break
      if len(scc) > 1:
        sccs.append(scc)

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return sorted((sorted(scc), _cycle_in(graph, scc)) for scc in sccs)


def _cycle_in(graph, scc: set[str]) -> list[str]:
  """A shortest cycle through the first module of `scc` (breadth-first inside it)."""
  start = min(scc)
  parent, frontier = {start: None}, [start]
  while frontier:
    nxt = []
    for v in frontier:
      for w in sorted(graph[v] & scc):
        if w == start:
          path = [v]
          while parent[path[-1]] is not None:
            path.append(parent[path[-1]])
          return [start, *reversed(path[:-1]), start]
        if w not in parent:
          parent[w] = v
          nxt.append(w)
    frontier = nxt
  raise AssertionError(f"no cycle in {scc}")


def command_violations(graph, commands=COMMANDS) -> list[str]:
  return [f"{src} imports the command module {dst}" for src, dsts in sorted(graph.items()) if src not in commands
          for dst in sorted(dsts) if dst in commands]


def layer_violations(graph, allowed=ALLOWED, commands=COMMANDS) -> list[str]:
  out = []
  for src, dsts in sorted(graph.items()):
    pkg = src.split(".")[1] if src.count(".") else None
    if pkg not in allowed or src in commands:
      continue
    for dst in sorted(dsts):
      other = dst.split(".")[1] if dst.count(".") else None
      if dst in commands:
        out.append(f"{src} ({pkg}) imports the command module {dst}")
      elif allowed[pkg] is not None and other not in allowed[pkg]:
        out.append(f"{src} ({pkg}) imports {dst} ({other}); {pkg} may import only {', '.join(sorted(allowed[pkg]))}")
  return out


@pytest.fixture(scope="module")
def graph():
  g = import_graph(ROOT)
  assert "jaxtrain.core.config" in g and "jaxtrain.train" in g and "jaxtrain.data.__main__" in g
  assert COMMANDS <= set(g), COMMANDS - set(g)
  return g


def test_no_import_circles(graph):
  found = circles(graph)
  assert not found, "import circles:\n" + "\n".join(
      f"{' -> '.join(cycle)}  (all of {', '.join(members)} import each other, directly or not)"
      for members, cycle in found)


def test_only_commands_import_commands(graph):
  found = command_violations(graph)
  assert not found, "\n".join(found)


def test_packages_import_only_their_own_layer_and_below(graph):
  found = layer_violations(graph)
  assert not found, "\n".join(found)


def test_every_subpackage_says_what_it_holds():
  inits = sorted(p for p in ROOT.rglob("__init__.py") if p.parent != ROOT)
  assert {p.parent.name for p in inits} >= {"core", "model", "parallel", "run", "analysis", "data", "interop"}
  bad = []
  for p in inits:
    doc = ast.get_docstring(ast.parse(p.read_text())) or ""
    if doc.strip().lower().rstrip(".") in ("", "placeholder", "todo", "tbd") or len(doc.split()) < 3:
      bad.append(f"{p.relative_to(ROOT.parent)}: {doc!r}")
  assert not bad, "subpackages without a docstring saying what they hold:\n" + "\n".join(bad)


# --- the checks themselves, on a package with known faults

def _write(root: pathlib.Path, files: dict[str, str]):
  for name, text in files.items():
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_graph_builder_finds_a_known_circle(tmp_path):
  pkg = tmp_path / "pkg"
  _write(pkg, {
      "__init__.py": '"""A package."""\n',
      "a.py": "def f():\n  from pkg import b  # inside a function\n  return b\n",
      "b.py": "from . import c\n",  # relative
      "c.py": "import os\nif True:\n  import pkg.a as a_mod\n",
      "d.py": "from pkg.a import f\nfrom pkg.sub.e import g\n",  # imports into the circle: not part of it
      "sub/__init__.py": "",
      "sub/e.py": "from ..d import f\n",  # d <-> sub.e: a second circle, two levels
  })
  g = import_graph(pkg)
  assert g["pkg.a"] == {"pkg.b"} and g["pkg.b"] == {"pkg.c"} and g["pkg.c"] == {"pkg.a"}
  assert g["pkg.d"] == {"pkg.a", "pkg.sub.e"} and g["pkg.sub.e"] == {"pkg.d"}
  assert circles(g) == [(["pkg.a", "pkg.b", "pkg.c"], ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]),
                        (["pkg.d", "pkg.sub.e"], ["pkg.d", "pkg.sub.e", "pkg.d"])]
  with pytest.raises(AssertionError, match=r"pkg\.a -> pkg\.b -> pkg\.c -> pkg\.a"):
    test_no_import_circles(g)
  del g["pkg.c"]
  g["pkg.sub.e"] = set()
  assert circles(g) == []


def test_the_layer_checks_find_known_violations():
  g = {"jaxtrain.core.config": {"jaxtrain.model.transformer"},
       "jaxtrain.model.block": {"jaxtrain.parallel.plan", "jaxtrain.model.ops"},
       "jaxtrain.model.transformer": {"jaxtrain.core.config", "jaxtrain.run.step"},
       "jaxtrain.parallel.mesh": {"jaxtrain.model.transformer", "jaxtrain.core.config"},
       "jaxtrain.analysis.compare": {"jaxtrain.bench", "jaxtrain.run.step"},
       "jaxtrain.run.step": {"jaxtrain.parallel.mesh"},
       "jaxtrain.bench": {"jaxtrain.cli", "jaxtrain.analysis.compare"},
       "jaxtrain.data.__main__": {"jaxtrain.cli", "jaxtrain.data.pipeline"},
       "jaxtrain.data.pipeline": set()}
  assert command_violations(g) == ["jaxtrain.analysis.compare imports the command module jaxtrain.bench"]
  assert layer_violations(g) == [
      "jaxtrain.analysis.compare (analysis) imports the command module jaxtrain.bench",
      "jaxtrain.core.config (core) imports jaxtrain.model.transformer (model); core may import only core",
      "jaxtrain.model.block (model) imports jaxtrain.parallel.plan (parallel); model may import only core, model",
      "jaxtrain.model.transformer (model) imports jaxtrain.run.step (run); model may import only core, model",
  ]


# --- every module has its test file, tests/<package>/test_<module>.py (commands: tests/commands/test_<name>.py),
# or is named here with the test that covers it and the words that show it does

COVERED_BY = {
    "jaxtrain.analysis.activation_bytes": ("tests/analysis/test_memory.py", "memory.activations"),
    "jaxtrain.analysis.baselines.minimal": ("tests/analysis/test_baselines.py", "minimal"),
    "jaxtrain.analysis.baselines.torch_model": ("tests/analysis/test_baselines.py", "torch_model"),
    "jaxtrain.analysis.compare": ("tests/parity/test_moe_parity.py", "bench_compare"),
    "jaxtrain.analysis.fit": ("tests/analysis/test_memory.py", "fit."),
    "jaxtrain.analysis.report": ("tests/commands/test_inspect.py", "report"),
    "jaxtrain.analysis.speed": ("tests/commands/test_bench.py", "speed"),
    "jaxtrain.cli": ("tests/commands/test_flows.py", "exit"),
    "jaxtrain.model.activation": ("tests/model/test_gptoss.py", "activation"),
    "jaxtrain.launch.__main__": ("tests/launch/test_supervisor.py", "jaxtrain.launch"),
    "jaxtrain.goodput": ("tests/run/test_goodput.py", "jaxtrain.goodput"),
    "jaxtrain.interop.tasks": ("tests/run/test_eval_tasks.py", "tasks_lib"),
    "jaxtrain.plan": ("tests/analysis/test_planner.py", "jaxtrain.plan"),
    "jaxtrain.core.checks": ("tests/core/test_config.py", "must divide"),
    "jaxtrain.core.dependent": ("tests/core/test_dependent_keys.py", "config.DEPENDENT"),
    "jaxtrain.core.errors": ("tests/core/test_config.py", "UserError"),
    "jaxtrain.core.files": ("tests/run/test_filecheck.py", "files"),
    "jaxtrain.core.parse": ("tests/core/test_bad_inputs.py", "parse."),
    "jaxtrain.core.ramp": ("tests/run/test_batch_ramp.py", "ramp."),
    "jaxtrain.interop.hf_fields": ("tests/core/test_bad_inputs.py", "config.json"),
    "jaxtrain.interop.hf_keys": ("tests/interop/test_gemma3.py", "model_keys"),
    "jaxtrain.interop.hf_table": ("tests/interop/test_params_only_import.py", "hf.table"),
    "jaxtrain.core.resources": ("tests/commands/test_launch.py", "resources"),
    "jaxtrain.core.schema": ("tests/core/test_config.py", "all_keys"),
    "jaxtrain.data.__main__": ("tests/commands/test_flows.py", "jaxtrain.data"),
    "jaxtrain.data.pairs": ("tests/run/test_dpo.py", "PairPacker"),
    "jaxtrain.data.readers": ("tests/data/test_prepare.py", "jsonl"),
    "jaxtrain.data.shards": ("tests/data/test_prepare.py", "shards"),
    "jaxtrain.generate": ("tests/interop/test_generate.py", "jaxtrain.generate"),
    "jaxtrain.eval": ("tests/interop/test_harness.py", "jaxtrain.eval"),
    "jaxtrain.hf": ("tests/commands/test_flows.py", "hf_command"),
    "jaxtrain.interop.decode": ("tests/interop/test_generate.py", "decode"),
    "jaxtrain.interop.hf_deepseek": ("tests/interop/test_deepseek.py", "DeepseekV3"),
    "jaxtrain.interop.hf_gemma3": ("tests/interop/test_gemma3.py", "gemma3_text"),
    "jaxtrain.interop.hf_rope": ("tests/interop/test_hf.py", "hf_rope"),
    "jaxtrain.interop.hf_export": ("tests/interop/test_hf.py", "hf_export"),
    "jaxtrain.model.attention": ("tests/model/test_transformer.py", "attention"),
    "jaxtrain.model.block": ("tests/model/test_transformer.py", "Transformer"),
    "jaxtrain.model.flops": ("tests/commands/test_bench.py", "flops"),
    "jaxtrain.model.layers": ("tests/model/test_mtp.py", "layers"),
    "jaxtrain.model.moe": ("tests/parallel/test_experts.py", "moe"),
    "jaxtrain.model.moe_balance": ("tests/parity/test_moe_parity.py", "moe_balance"),
    "jaxtrain.model.moe_kernels": ("tests/parity/test_moe_parity.py", "dropless"),
    "jaxtrain.model.ops": ("tests/model/test_loss.py", "ops.use"),
    "jaxtrain.model.rope": ("tests/model/test_mla.py", "rope"),
    "jaxtrain.parallel.devices": ("tests/parallel/test_kernels.py", "devices"),
    "jaxtrain.parallel.distributed": ("tests/multihost/test_multihost.py", "distributed"),
    "jaxtrain.parallel.expert_layout": ("tests/parity/test_moe_parity.py", "moe_layout"),
    "jaxtrain.parallel.experts_dropless": ("tests/parity/test_moe_parity.py", "dropless"),
    "jaxtrain.parallel.placement": ("tests/multihost/test_multihost.py", "rows"),
    "jaxtrain.parallel.program": ("tests/parallel/test_schedule.py", "program.program_table"),
    "jaxtrain.run.faults": ("tests/recovery/test_recovery.py", "JAXTRAIN_FAULTS"),
    "jaxtrain.run.grads": ("tests/run/test_step.py", "grads_of"),
    "jaxtrain.run.layout": ("tests/parity/test_zero_parity.py", "layout"),
    "jaxtrain.run.loop": ("tests/commands/test_train.py", "jaxtrain.train"),
    "jaxtrain.run.observe": ("tests/commands/test_train.py", "profile_steps"),
    "jaxtrain.run.offload": ("tests/parity/test_zero_parity.py", "offload"),
    "jaxtrain.run.optimizer": ("tests/run/test_step.py", "optim_lib"),
    "jaxtrain.run.progress": ("tests/run/test_precision.py", "progress"),
    "jaxtrain.run.runfiles": ("tests/run/test_checkpoint.py", "runfiles"),
    "jaxtrain.run.runs": ("tests/interop/test_hf.py", "runs"),
}


def own_test(module: str) -> pathlib.Path:
  parts = module.split(".")[1:]
  return ROOT.parent / ("tests/commands" if len(parts) == 1 else "tests") / pathlib.Path(*parts[:-1]) / \
      f"test_{parts[-1]}.py"


def test_every_module_has_its_test_file_or_a_named_one_that_covers_it():
  missing, stale = [], []
  for module in module_names(ROOT):
    if module.count(".") == 0 or module.endswith(".__init__") or module_names(ROOT)[module].name == "__init__.py":
      continue
    if own_test(module).exists():
      stale += [module] if module in COVERED_BY else []
      continue
    named = COVERED_BY.get(module)
    path = ROOT.parent / named[0] if named else None
    if path is None or not path.exists() or named[1] not in path.read_text():
      missing.append(f"{module}: no {own_test(module).relative_to(ROOT.parent)}, and COVERED_BY names "
                     f"{named or 'nothing'}")
  assert not missing, "\n".join(missing)
  assert not stale, f"have their own test file now, drop them from COVERED_BY: {stale}"
