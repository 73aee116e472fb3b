"""The cluster launch files parse and agree with the mesh presets they name."""

import math
import re
import subprocess
from pathlib import Path

import yaml

from jaxtrain.core import config
from jaxtrain.parallel import mesh as mesh_lib
from tests.conftest import REPO

LAUNCH = Path(REPO) / "jaxtrain" / "launch"


def _flag(args, name):
  return args[args.index(name) + 1]


def _heartbeat(args) -> float:
  """The trainer's distributed.heartbeat_timeout_s: a restart must come after the survivors have exited."""
  sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
  return float(next(v.split("=", 1)[1] for v in sets if v.startswith("distributed.heartbeat_timeout_s=")))


def test_jobset_manifest_is_an_indexed_job_consistent_with_its_mesh():
  doc = yaml.safe_load((LAUNCH / "jobset.yaml").read_text())
  assert doc["apiVersion"].startswith("jobset.x-k8s.io/") and doc["kind"] == "JobSet"
  rjob = doc["spec"]["replicatedJobs"][0]
  job = rjob["template"]["spec"]
  assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
  container = job["template"]["spec"]["containers"][0]
  command = container["command"]
  assert command[:3] == ["python", "-m", "jaxtrain.launch"]  # the supervisor, then the trainer's arguments
  args = command[command.index("--") + 1:]
  assert float(_flag(command, "--backoff-s")) > _heartbeat(args)
  n = int(_flag(args, "--num-processes"))
  assert n == job["completions"] and _flag(args, "--process-id") == "$(JOB_COMPLETION_INDEX)"
  # JobSet's pod 0 of job 0 is <jobset>-<replicatedJob>-0-0 under the <jobset> headless service.
  host, port = _flag(args, "--coordinator").rsplit(":", 1)
  assert host == f"{doc['metadata']['name']}-{rjob['name']}-0-0.{doc['metadata']['name']}"
  assert int(port) == container["ports"][0]["containerPort"]
  sizes, dcn = mesh_lib.parse_full(_flag(args, "--mesh"))
  assert math.prod(dcn.values()) == n
  assert math.prod(sizes.values()) == n * container["resources"]["limits"]["nvidia.com/gpu"]
  config.load(_flag(args, "--config"))


def test_slurm_script_is_valid_bash_consistent_with_its_mesh():
  path = LAUNCH / "slurm.sbatch"
  assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
  text = path.read_text()
  opts = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
  nodes, per_node, gpus = int(opts["nodes"]), int(opts["ntasks-per-node"]), int(opts["gpus-per-node"])
  command = text[text.index("\nsrun "):].replace("\\\n", " ").split()
  assert "jaxtrain.launch" in command and "--coordinator" not in command  # JAX detects SLURM
  assert float(_flag(command, "--backoff-s")) > _heartbeat(command[command.index("--") + 1:])
  sizes, dcn = mesh_lib.parse_full(_flag(command, "--mesh"))
  assert math.prod(dcn.values()) == nodes * per_node
  assert math.prod(sizes.values()) == nodes * gpus
  config.load(_flag(command, "--config"))
