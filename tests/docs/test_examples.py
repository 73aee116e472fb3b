"""The examples of README.md and docs/*.md run as written.

Convention for the pages:

- `<!-- runnable -->` on the line right before a ```bash or ```sh fence marks the block as an
  example that runs on a CPU-only machine (2 cores) in about a minute at most, with nothing but
  a checkout and its installed dependencies: no GPU, network, cluster, or downloaded files.
  `<!-- runnable expect="TEXT" -->` (any number of `expect="..."`) also requires TEXT in what
  the block prints.
- `<!-- output -->` on the line right before a fence marks that block as output of the nearest
  runnable block above it: each of its lines except `...` must be a line of what that block
  printed (leading and trailing blanks ignored).
- Environment set-up in a runnable block (`python3 -m venv ...`, `. .venv/bin/activate`,
  `pip install ...`, as `&&` steps or lines) is not run: the test runs in the environment it
  was started in. A runnable block never runs pytest.
- Blocks without the marker are not run: synopses with placeholders, and commands that need a
  GPU, the gpu-aot extra, a network, a cluster, a downloaded checkpoint, or minutes of CPU.
  Where the reason is not plain from the text, `<!-- not runnable: REASON -->` says it.

How they run (test_examples): per page, its runnable blocks in order, each as one script under
`bash -e -o pipefail`, all in one fresh copy of the checkout (jaxtrain/, configs/, meshes/,
tests/, pyproject.toml; from a source tree jaxtrain reads configs/ and meshes/ where they are,
jaxtrain/core/resources.py), so what one block writes (`runs/...`) is there for the next, as
for a reader who runs them in order. `python` is this interpreter, PYTHONPATH the copy;
JAX_PLATFORMS=cpu and no inherited XLA_FLAGS but the suite's (LLVM at -O0, tests/suite_env.py), as on a
machine without a GPU (the commands simulate the CPU devices a mesh needs). Each block must exit 0 within BLOCK_TIMEOUT_S.
Every page runs after README's set-up command (its first runnable block), as a reader who followed it: the set-up
runs once, in a checkout that each page's copy starts from (so a guide's command that lands on the set-up's
`runs/tiny`, or an import into a workdir another page fills, fails here), and README's own test goes on from there.

What a reader brings, named by a runnable block at a path of STAND_INS, is a stand-in the test makes there: a
downloaded checkpoint (`~/models/Llama-3.2-1B`: a tiny 2-layer Llama with a tokenizer.json, tests/hf_models.stand_in,
under a `$HOME` of the test's own), their own data (`prefs.jsonl`: 200 preference records), so such a flow runs as
written. test_documented_workdirs_are_each_one_pages checks every page's commands,
runnable or not: a workdir that one page trains or imports into is no other page's.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.suite_env import SUITE_XLA_FLAGS

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COPIED = ("jaxtrain", "configs", "meshes", "tests", "pyproject.toml")
BLOCK_TIMEOUT_S = 600
SET_UP = REPO / "README.md"  # its first runnable block is the set-up command every page runs after


def _prefs_jsonl(path: Path) -> None:
  rows = [{"prompt": f"Question {i}: what is {i} plus {i}? ", "chosen": f"{2 * i}.",
           "rejected": f"{2 * i + 1}, I think."} for i in range(200)]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _checkpoint(path: Path) -> None:
  from tests import hf_models
  hf_models.stand_in(path)


# what a page names that a reader brings (a downloaded checkpoint under ~, their own data in the working directory)
# -> the tiny stand-in the test makes there
STAND_INS = {"~/models/Llama-3.2-1B": _checkpoint, "prefs.jsonl": _prefs_jsonl}

_FENCE = re.compile(r"^(\s*)(```+)\s*(\S*)")
_RUNNABLE = re.compile(r'^\s*<!--\s*runnable((?:\s+expect="[^"]*")*)\s*-->\s*$')
_OUTPUT = re.compile(r"^\s*<!--\s*output\s*-->\s*$")
_EXPECT = re.compile(r'expect="([^"]*)"')
_SETUP = re.compile(r"^\s*(python3?\s+-m\s+venv\b|(\.|source)\s+\S*activate\b|(python3?\s+-m\s+)?pip3?\s+install\b)")


@dataclass
class Block:
  page: Path
  line: int  # 1-based line of the opening fence
  lang: str
  body: str
  marker: str  # the comment line before the fence, stripped ("" if none)
  expect: list[str] = field(default_factory=list)

  @property
  def where(self) -> str:
    return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
  """The fenced blocks of a page with the marker line before each."""
  lines = page.read_text().splitlines()
  found, i = [], 0
  while i < len(lines):
    m = _FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    indent, ticks, lang = m.groups()
    j = i + 1
    while j < len(lines) and lines[j].strip() != ticks:
      j += 1
    body = "\n".join(l[len(indent):] if l.startswith(indent) else l.lstrip() for l in lines[i + 1:j])
    prev = lines[i - 1].strip() if i else ""
    marker = prev if prev.startswith("<!--") else ""
    found.append(Block(page, i + 1, lang, body, marker))
    i = j + 1
  return found


def script(block: Block) -> str:
  """The block without its environment set-up steps."""
  out = []
  for line in block.body.splitlines():
    steps = re.split(r"\s*&&\s*", line)
    kept = [s for s in steps if not _SETUP.match(s)]
    out.append(line if len(kept) == len(steps) else " && ".join(kept))
  return "\n".join(out)


def examples(page: Path) -> list[tuple[Block, list[Block]]]:
  """The runnable blocks of a page, in order, each with the output blocks that follow it."""
  runs: list[tuple[Block, list[Block]]] = []
  for b in blocks(page):
    if m := _RUNNABLE.match(b.marker):
      b.expect = _EXPECT.findall(m.group(1))
      runs.append((b, []))
    elif _OUTPUT.match(b.marker) and runs:
      runs[-1][1].append(b)
  return runs


def test_markers_are_well_formed():
  """Fast: markers sit before fences of the right kind; no runnable block installs or runs the suite."""
  problems, count = [], 0
  for page in PAGES:
    text = page.read_text().splitlines()
    marked = {b.line - 1 for b in blocks(page) if b.marker}
    for n, line in enumerate(text, 1):
      s = line.strip()
      if (s.startswith("<!-- runnable") or s.startswith("<!-- output")) and n not in marked:
        problems.append(f"{page.relative_to(REPO)}:{n}: marker not on the line right before a fence")
    for b in blocks(page):
      if b.marker.startswith("<!-- runnable") or b.marker.startswith("<!-- output"):
        if not (_RUNNABLE.match(b.marker) or _OUTPUT.match(b.marker)):
          problems.append(f"{b.where}: malformed marker {b.marker!r}")
    runs = examples(page)
    first = runs[0][0].line if runs else None
    for b in blocks(page):
      if _OUTPUT.match(b.marker) and (first is None or b.line < first):
        problems.append(f"{b.where}: <!-- output --> with no runnable block above it")
    for b, _ in runs:
      count += 1
      if b.lang not in ("bash", "sh"):
        problems.append(f"{b.where}: runnable block is ```{b.lang}, not ```bash or ```sh")
      if "pytest" in b.body:
        problems.append(f"{b.where}: a runnable block must not run pytest")
      if "pip install" in script(b) or ".venv" in script(b):
        problems.append(f"{b.where}: an install step is left after removing the set-up steps")
  assert not problems, "\n".join(problems)
  assert examples(REPO / "README.md"), "README.md has no <!-- runnable --> block"
  assert count


def _workdir(tmp: Path) -> Path:
  work = tmp / "checkout"
  work.mkdir()
  ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache")
  for name in COPIED:
    src = REPO / name
    if src.is_dir():
      shutil.copytree(src, work / name, ignore=ignore)
    else:
      shutil.copy2(src, work / name)
  return work


def _env(tmp: Path, work: Path) -> dict[str, str]:
  bin_dir = tmp / "bin"
  bin_dir.mkdir()
  for name in ("python", "python3"):  # a wrapper, not a link: a venv's interpreter finds its venv by its own path
    wrapper = bin_dir / name
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAXTRAIN_FAULTS", "PYTHONPATH")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(SUITE_XLA_FLAGS), PYTHONPATH=str(work), PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}")
  return env


def _tail(text: str, n: int = 60) -> str:
  lines = text.splitlines()
  return "\n".join((["..."] if len(lines) > n else []) + lines[-n:])


def _run(code: str, cwd: Path, env: dict[str, str]) -> tuple[int | None, str]:
  """(exit status, stdout and stderr) of `code` under bash -e; status None after BLOCK_TIMEOUT_S, its processes ended."""
  proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", code], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    return proc.returncode, out
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)  # the block's own process group: bash and the commands it started
    out, _ = proc.communicate()
    return None, out


def _check(block: Block, outputs: list[Block], code: str, status: int | None, out: str) -> None:
  shown = f"--- block ---\n{code}\n--- output ---\n{_tail(out)}"
  if status is None:
    pytest.fail(f"{block.where}: still running after {BLOCK_TIMEOUT_S} s\n{shown}", pytrace=False)
  if status != 0:
    pytest.fail(f"{block.where}: exit status {status}\n{shown}", pytrace=False)
  printed = {l.strip() for l in out.splitlines()}
  missing = [t for t in block.expect if t not in out]
  for page_output in outputs:
    missing += [l.strip() for l in page_output.body.splitlines()
                if l.strip() not in ("", "...") and l.strip() not in printed]
  if missing:
    pytest.fail(f"{block.where}: the page says it prints what it did not:\n  " + "\n  ".join(missing) + f"\n{shown}",
                pytrace=False)


@pytest.fixture(scope="module")
def set_up(tmp_path_factory):
  """(checkout after README's set-up command, that block with its outputs, its exit status, what it printed)."""
  tmp = tmp_path_factory.mktemp("set-up")
  work = _workdir(tmp)
  block, outputs = examples(SET_UP)[0]
  return (work, block, outputs, *_run(script(block), work, _env(tmp, work)))


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("page", [p for p in PAGES if examples(p)], ids=lambda p: str(p.relative_to(REPO)))
def test_examples(page, set_up, tmp_path):
  template, first, first_outputs, status, out = set_up
  _check(first, first_outputs, script(first), status, out)
  work = tmp_path / "checkout"
  shutil.copytree(template, work, symlinks=True)
  env = _env(tmp_path, work)
  env["HOME"] = str(tmp_path / "home")
  runnable = examples(page)
  for path, make in STAND_INS.items():
    if any(path in b.body for b, _ in runnable):
      make(Path(env["HOME"]) / path[2:] if path.startswith("~/") else work / path)
  for block, outputs in runnable:
    if (block.page, block.line) == (first.page, first.line):
      continue  # the set-up, run above
    code = script(block)
    _check(block, outputs, code, *_run(code, work, env))


_WRITES = re.compile(r"python3? -m jaxtrain\.(train|launch|hf\s+import)\b")


def written_workdirs(block: Block) -> list[str]:
  """The workdirs that a block's train, launch and hf import commands write (train's default: runs/<config>);
  synopsis lines (with [optional] parts) left out."""
  found = []
  for line in re.sub(r"\\\n\s*", " ", block.body).splitlines():
    for part in re.split(r"&&|;|\|", line.split(" #")[0]):
      if not (m := _WRITES.search(part)) or "[" in part:
        continue
      words = shlex.split(part[m.start():])
      if "--workdir" in words:
        found.append(words[words.index("--workdir") + 1].rstrip("/"))
      elif m.group(1) != "hf import":
        found.append(f"runs/{Path(words[words.index('--config') + 1]).stem if '--config' in words else 'tiny'}")
  return found


def test_documented_workdirs_are_each_one_pages():
  """Fast: a reader who runs the set-up, then every page's commands in order, never trains or imports into a
  workdir that another page (or the set-up, runs/tiny) filled: docs/training.md's DPO command without --workdir
  landed on the set-up's run, and README and docs/huggingface.md imported into the same runs/ft."""
  pages: dict[str, set[str]] = {}
  for page in PAGES:
    for b in blocks(page):
      if b.lang in ("bash", "sh"):
        for w in written_workdirs(b):
          pages.setdefault(w, set()).add(str(page.relative_to(REPO)))
  assert "runs/tiny" in pages and pages["runs/tiny"] == {"README.md"}, pages.get("runs/tiny")
  shared = {w: sorted(p) for w, p in pages.items() if len(p) > 1}
  assert not shared, shared
