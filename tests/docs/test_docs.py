"""The README front door and the docs/ pages: generated config reference, size, links."""

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 400


def _gen_config():
  spec = importlib.util.spec_from_file_location("jaxtrain_docs_gen_config", DOCS / "gen_config.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_config_reference_is_current():
  gen = _gen_config()
  assert (DOCS / "config.md").read_text() == gen.generate(), (
      f"docs/config.md is out of date with `python -m jaxtrain.train --help-config`; "
      f"regenerate it with `{gen.COMMAND}` from the repository root")


def test_readme_is_short():
  n = len(README.read_text().splitlines())
  assert n <= MAX_README_LINES, f"README.md has {n} lines, at most {MAX_README_LINES}: move detail into docs/"


_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _pages():
  return [README, *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
  text = _FENCE.sub("", page.read_text())
  broken = []
  for target in _LINK.findall(text):
    if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
      continue  # absolute URL or an anchor on the same page
    path = target.split("#", 1)[0]
    if not (page.parent / path).exists():
      broken.append(target)
  assert not broken, f"{page.relative_to(REPO)}: links to missing files: {broken}"


def test_readme_keeps_the_setup_commands():
  text = README.read_text()
  assert "python -m pytest -q -n 2" in text  # CI runs exactly this command
  assert "python -m jaxtrain.train" in text
