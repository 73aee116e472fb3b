"""The goodput ledger: its arithmetic on written events (fast), and a real job killed and restarted under the
supervisor, against the wall time the test measures and the steps its metrics show redone (slow)."""

import re
import subprocess
import sys
import time

import pytest

from jaxtrain.run import goodput
from tests.multihost import procs as multihost

# A supervised job: trainer 1 does steps 1-2, commits 2, computes 3, dies in 4; trainer 2 resumes at 2 and redoes
# 3 (and 4: these events end at 3).
EVENTS = [
    {"ev": "job", "t": 100.0}, {"ev": "attempt", "t": 101.0}, {"ev": "start", "t": 101.0, "resumed": 0},
    {"ev": "spent", "t": 103.0, "cat": "startup", "s": 2.0}, {"ev": "spent", "t": 104.0, "cat": "compile", "s": 1.0},
    {"ev": "spent", "t": 105.0, "cat": "productive", "s": 0.75, "step": 1},
    {"ev": "spent", "t": 105.0, "cat": "data_wait", "s": 0.25, "step": 1},
    {"ev": "spent", "t": 106.0, "cat": "productive", "s": 1.0, "step": 2},
    {"ev": "spent", "t": 106.5, "cat": "checkpoint", "s": 0.5},
    {"ev": "spent", "t": 107.5, "cat": "productive", "s": 1.0, "step": 3},
    {"ev": "spent", "t": 107.5, "cat": "data_wait", "s": 0.0, "step": 4},
    {"ev": "ended", "t": 109.0, "cause": "signal SIGKILL"},
    {"ev": "attempt", "t": 110.0}, {"ev": "start", "t": 110.0, "resumed": 2},
    {"ev": "spent", "t": 111.0, "cat": "startup", "s": 1.0}, {"ev": "spent", "t": 111.5, "cat": "restore", "s": 0.5},
    {"ev": "spent", "t": 112.5, "cat": "productive", "s": 1.0, "step": 3},
    {"ev": "spent", "t": 113.0, "cat": "eval", "s": 0.5},
    {"ev": "end", "t": 113.5}, {"ev": "ended", "t": 114.0, "cause": "exit 0"}, {"ev": "job_end", "t": 114.5},
]


def test_every_second_falls_into_one_category():
  s = goodput.summarize(EVENTS)
  want = {"productive": 0.75 + 1.0 + 1.0, "startup": 1.0 + 2.0 + 1.0 + 1.0 + 0.5, "compile": 1.0, "restore": 0.5,
          "data_wait": 0.25, "checkpoint": 0.5, "eval": 0.5,
          "lost": 1.0 + 1.5,  # step 3, redone; and 107.5 -> 109, step 4 in flight when it died
          "restart": 1.0}
  assert s["seconds"] == pytest.approx(want) and s["wall_s"] == 14.5 and s["lost_steps"] == 2 and s["attempts"] == 2
  assert sum(s["seconds"].values()) == pytest.approx(s["wall_s"])
  assert goodput.describe(s).startswith("goodput 19.0%: productive 2.8s of 14.5s over 2 attempts; startup 5.5s, "
                                        "lost 2.5s (2 steps redone)")


def test_a_later_run_on_the_same_workdir_is_a_new_job_and_a_failed_one_is_not():
  first = [{"ev": "start", "t": 0.0, "resumed": 0}, {"ev": "spent", "t": 1.0, "cat": "productive", "s": 1.0, "step": 1}]
  done = first + [{"ev": "end", "t": 1.0}]
  later = [{"ev": "start", "t": 500.0, "resumed": 1}, {"ev": "spent", "t": 501.0, "cat": "productive", "s": 1.0,
                                                        "step": 2}, {"ev": "end", "t": 501.0}]
  assert goodput.summarize(done + later)["wall_s"] == 1.0  # the idle day between is no part of either job
  s = goodput.summarize(first + later)  # the first died: a person ran it again, 499 s later
  assert s["wall_s"] == 501.0 and s["seconds"]["restart"] == 499.0 and s["attempts"] == 2


def test_the_ledger_waits_for_the_workdir(tmp_path):
  ledger = goodput.Ledger(tmp_path / "w")
  ledger.event("job", t=1.0)
  assert not (tmp_path / "w").exists()  # a refused run leaves nothing
  (tmp_path / "w").mkdir()
  ledger.event("attempt", t=2.0)
  assert [e["ev"] for e in goodput.read(tmp_path / "w")] == ["job", "attempt"]


@pytest.mark.slow
def test_a_killed_and_restarted_job_adds_up_to_its_wall_time(tmp_path):
  train = ["--mesh", "fsdp=2", "--steps", "6", "--set", "checkpoint.interval=2", "--set", "checkpoint.async_save=false",
           "--workdir", "w"]
  env = multihost.clean_env({"JAXTRAIN_FAULTS": f"kill=step:4:0:{tmp_path / 'killed'}"})
  t0 = time.time()
  r = subprocess.run([sys.executable, "-m", "jaxtrain.launch", "--backoff-s", "1", "--", *train], cwd=tmp_path,
                     env=env, capture_output=True, text=True, timeout=600)
  wall = time.time() - t0
  assert r.returncode == 0 and (tmp_path / "killed").exists(), r.stderr[-3000:]
  s = goodput.summarize(goodput.read(tmp_path / "w"))
  assert abs(sum(s["seconds"].values()) - wall) <= 0.01 * wall, (s, wall)
  # the steps redone: the trainer died in step 4 (after dispatching it), the second one resumed at its checkpoint
  resumed = int(re.search(r"resumed from \S+ at step (\d+)", r.stdout)[1])
  assert s["lost_steps"] == 4 - resumed == 2, s
  assert s["seconds"]["restart"] >= 1.0 and s["seconds"]["productive"] > 0 and s["attempts"] == 2
  said = [line for line in r.stdout.splitlines() if line.startswith("goodput ")]
  assert len(said) == 1 and "(2 steps redone)" in said[0], r.stdout[-2000:]
  shown = subprocess.run([sys.executable, "-m", "jaxtrain.goodput", "w"], cwd=tmp_path, capture_output=True, text=True,
                         env=multihost.clean_env())
  assert shown.returncode == 0 and shown.stdout.startswith("goodput ") and "restart" in shown.stdout


def test_goodput_command_without_a_ledger_is_one_line(run_cli, tmp_path):
  r = run_cli("jaxtrain.goodput", str(tmp_path))
  assert r.returncode == 2 and r.stderr.strip() == (f"jaxtrain.goodput: error: {tmp_path}: no goodput.jsonl there; "
                                                    "give the --workdir of a run (train or launch write the ledger)")


def test_the_compile_says_whether_the_cache_served_it(tmp_path):
  import jax
  import jax.numpy as jnp
  was = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  salt = time.time_ns() % 1000003 / 7.0  # a program no earlier run can have cached
  try:
    verdicts = []
    for _ in range(2):  # compiled, then (a new function object, the same program) loaded
      count = goodput.CacheCount()
      jax.jit(lambda x: jnp.sin(x) * salt).lower(jnp.ones(7)).compile()
      count.stop()
      verdicts.append(count.verdict())
  finally:
    jax.config.update("jax_compilation_cache_dir", was[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", was[1])
  assert verdicts == ["miss", "hit"]


# A ledger no trainer wrote (issue 54): each bad record, on line 2 after a good one, and the words that name it.
FOREIGN = {
    "object-without-ev": (b"{}", "is not an event"),
    "array": (b"[1, 2]", "is not an event"),
    "null": (b"null", "is not an event"),
    "unknown-event": (b'{"ev": "nap", "t": 3}', "is not an event"),
    "no-t": (b'{"ev": "end"}', "without 't'"),
    "t-a-string": (b'{"ev": "end", "t": "soon"}', 't "soon" is not a finite number'),
    "t-nan": (b'{"ev": "end", "t": NaN}', "t NaN is not a finite number"),
    "t-infinite": (b'{"ev": "end", "t": -Infinity}', "t -Infinity is not a finite number"),
    "t-true": (b'{"ev": "end", "t": true}', "t true is not a finite number"),
    "unknown-category": (b'{"ev": "spent", "t": 3, "cat": "nap", "s": 1}', 'cat "nap" is not one of productive'),
    "spent-without-seconds": (b'{"ev": "spent", "t": 3, "cat": "eval"}', "without 's'"),
    "negative-seconds": (b'{"ev": "spent", "t": 3, "cat": "eval", "s": -2}', "s -2 is not a finite number"),
    "step-a-float": (b'{"ev": "spent", "t": 3, "cat": "eval", "s": 1, "step": 1.5}', "step 1.5 is not an integer"),
    "not-utf8": (b'{"ev": "end", "t": 3, "cause": "\xff"}', "not UTF-8 text"),
    "not-json": (b"hello", "not a JSON record"),
}


@pytest.mark.parametrize("case", sorted(FOREIGN))
def test_a_ledger_line_it_cannot_use_is_one_line_naming_file_line_and_fault(case, tmp_path, capsys):
  from jaxtrain import goodput as command
  bad, words = FOREIGN[case]
  (tmp_path / goodput.FILE).write_bytes(b'{"ev": "start", "t": 1.0, "resumed": 0}\n' + bad + b"\n")
  with pytest.raises(SystemExit) as e:
    command.main([str(tmp_path)])
  out, err = capsys.readouterr()
  assert e.value.code == 2 and not out and err.startswith(f"jaxtrain.goodput: error: {tmp_path / goodput.FILE}: "
                                                          "line 2: ") and len(err.splitlines()) == 1, err
  assert words in err, err


def test_a_line_cut_by_a_kill_is_skipped_and_any_other_non_json_line_refused(tmp_path):
  good = '{"ev": "start", "t": 1.0, "resumed": 0}\n{"ev": "end", "t": 3.0}\n'
  (tmp_path / goodput.FILE).write_text(good + '{"ev": "sp')  # the start of a line the writers write
  assert [e["ev"] for e in goodput.read(tmp_path)] == ["start", "end"]
  assert goodput.summarize(goodput.read(tmp_path))["wall_s"] == 2.0
  (tmp_path / goodput.FILE).write_text(good + "t,ev\n")  # a foreign file's line
  with pytest.raises(goodput.LedgerError, match=r"goodput.jsonl: line 3: not a JSON record"):
    goodput.read(tmp_path)


def test_start_up_begins_when_the_trainers_own_program_starts_not_the_shell_before_it(tmp_path):
  """`sh -c 'sleep 3; ...; exec python -m jaxtrain.train ...'` (a shell execs its last command: the trainer runs in
  the shell's process): the 3 s the shell spent first are no part of the trainer's start-up (issue 54)."""
  from tests.conftest import REPO
  from tests.helpers import clean_env
  now = f"{sys.executable} -c 'import time; print(time.time())'"
  probe = f"{sys.executable} -c 'from jaxtrain.run import goodput; print(goodput.process_start())'"
  env = clean_env(PYTHONPATH=REPO)
  env.pop(goodput.ATTEMPT_T, None)
  r = subprocess.run(["sh", "-c", f"sleep 3; {now}; exec {probe}; echo not reached"], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=60)
  before_exec, start = map(float, r.stdout.split())
  # (the shell's own few milliseconds of CPU before its exec may count: 50 ms of slack)
  assert before_exec - 0.05 <= start <= time.time() and start - before_exec < 2.0, (start - before_exec, r.stderr)
