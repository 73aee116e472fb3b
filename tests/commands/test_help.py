"""Every command's --help, and every subcommand's, prints its usage and exits 0 (argparse %-formats help texts:
a stray % in one is a traceback for the user who asks for help)."""

import argparse
import contextlib
import importlib
import io

import pytest

COMMANDS = ["jaxtrain.train", "jaxtrain.inspect", "jaxtrain.bench", "jaxtrain.debug", "jaxtrain.generate",
            "jaxtrain.hf", "jaxtrain.data.__main__", "jaxtrain.launch.__main__", "jaxtrain.plan"]


def _subcommands(module) -> list[str]:
  """The subcommand names of `module`'s parser, found by asking it for help with a name it cannot have."""
  captured = {}
  real = argparse.ArgumentParser.parse_args

  def spy(self, args=None, namespace=None):
    captured.setdefault("parser", self)
    raise SystemExit(0)
  argparse.ArgumentParser.parse_args = spy
  try:
    with contextlib.suppress(SystemExit):
      module.parse_args([])
  finally:
    argparse.ArgumentParser.parse_args = real
  actions = [a for a in captured["parser"]._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
  return [name for a in actions for name in a.choices]


@pytest.mark.parametrize("name", COMMANDS)
def test_help_of_every_command_and_subcommand_exits_0(name):
  module = importlib.import_module(name)
  for argv in (["--help"], *([sub, "--help"] for sub in _subcommands(module))):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
      module.parse_args(argv)
    assert e.value.code == 0 and "usage:" in out.getvalue(), (name, argv)
