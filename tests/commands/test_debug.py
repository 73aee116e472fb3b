"""`python -m jaxtrain.debug`: the command end to end (one subprocess: its lines and exit status) and its flags'
one-line refusals; the checks themselves are tests/run/test_protocol.py's."""

import pytest

from jaxtrain import debug
from tests.run.test_protocol import NAMES, SMALL


@pytest.mark.slow
def test_the_command_prints_one_verdict_per_check_and_exits_0_when_all_pass(run_cli):
  sets = [a for s in SMALL for a in ("--set", s)]
  r = run_cli("jaxtrain.debug", "--mesh", "data=2", *sets, "--overfit-steps", "60", "--resume-steps", "3",
              "--mesh-steps", "2", timeout=900)
  assert r.returncode == 0, r.stdout + r.stderr
  verdicts = [line for line in r.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
  assert [v.split(":")[0] for v in verdicts] == [f"PASS  {n}" for n in NAMES], r.stdout
  assert "debug: 5 of 5 passed" in r.stdout
  # the train loop's own lines (banner, steps, saves) went to its log, not the terminal
  assert "initialized and compiled" not in r.stdout and "checkpoint 3: saving" not in r.stdout


@pytest.mark.parametrize("flags, named", [(["--overfit-steps", "0"], "--overfit-steps 0"),
                                          (["--resume-steps", "-2"], "--resume-steps -2"),
                                          (["--mesh-rtol", "-1"], "--mesh-rtol -1"),
                                          (["--overfit-loss", "x"], "--overfit-loss")])
def test_bad_flags_are_one_line_exit_2(flags, named, capsys):
  with pytest.raises(SystemExit) as e:
    debug.main(flags)
  err = capsys.readouterr().err
  assert e.value.code == 2 and named in err and len(err.strip().splitlines()) == 1, err
