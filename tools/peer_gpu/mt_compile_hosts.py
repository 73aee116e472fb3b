"""Run the shared mt_gpu_compile.py (MaxText 0.2.5's train_compile.main over compile-only H100s) with
the compile-only devices spread over HOSTS hosts of NDEV/HOSTS GPUs (topology "1xHOSTSxNDEV/HOSTS"),
as jaxtrain.analysis.gpu_compile.mesh does for a 64-GPU mesh (8 hosts x 8). The shared script itself
always asks for one host.

usage: NDEV=64 HOSTS=8 PEER_GPU=/work/shared/peer/gpu python mt_compile_hosts.py OUT.json <maxtext key=value ...>
"""
import os, runpy, sys

SHARED = os.environ.get("PEER_GPU", "/work/shared/peer/gpu")
sys.path.insert(0, SHARED)
import gputarget  # noqa: E402  (the shared module; mt_gpu_compile imports this same object)

HOSTS = int(os.environ.get("HOSTS", "1"))
_devices = gputarget.devices


def devices(count=8, hosts=1):
  devs = _devices(count, HOSTS)
  print(f"mt_compile_hosts: {len(devs)} compile-only devices, topology 1x{HOSTS}x{count // HOSTS}; "
        f"first {devs[0]!r} last {devs[-1]!r}", flush=True)
  return devs


gputarget.devices = devices
script = os.path.join(SHARED, "mt_gpu_compile.py")
sys.argv = [script] + sys.argv[1:]
runpy.run_path(script, run_name="__main__")
