"""jaxtrain's step predictor (jaxtrain.analysis.overlap.report) on a saved optimized HLO (res/CASE.hlo.gz,
written by the shared record.py for either side), with the H100 row of jaxtrain's device table.

usage: PYTHONPATH=<jaxtrain tree> python predict.py CASE [CASE ...]   (reads $P/res/CASE.hlo.gz,
       writes $P/res/CASE.overlap.json; prints one line per case)
"""
import gzip, json, math, os, re, sys

from jaxtrain.analysis import gpu_compile, overlap
from jaxtrain.parallel import devices

# overlap.group_size reads `replica_groups=mesh[...] {axes}` but not the form with an explicit device
# order, `replica_groups=mesh['axis_0'=8,...,'axis_3'=8], device_ids=([8,8]T(1,0)) {'axis_0'}` (a
# collective over a mesh axis that is not the major one): it answers 1 there, so such a collective gets
# 0 wire bytes and 0 s. MaxText's Mixtral step has 11 of them (the expert-weight gathers). Read them
# here (PREDICT_GROUPS=orig keeps jaxtrain's reading, to show the difference).
_group_size = overlap.group_size
_MESH_IDS = re.compile(r"replica_groups=mesh\[([^\]]*)\], device_ids=\S+ \{([^}]*)\}")


def group_size(rest):
  m = _MESH_IDS.search(rest)
  if m:
    sizes = {k.strip("' "): int(v) for k, v in (x.split("=") for x in m.group(1).split(","))}
    return math.prod(sizes[a.strip("' ")] for a in m.group(2).split(",") if a.strip("' "))
  return _group_size(rest)


if os.environ.get("PREDICT_GROUPS") != "orig":
  overlap.group_size = group_size

P = os.environ.get("P", os.path.join(os.environ.get("TMPDIR", "/tmp"), "jaxtrain-gpupeer"))
G = 2**30


def main():
  row = devices.of("H100").entry
  for case in sys.argv[1:]:
    text = gzip.open(f"{P}/res/{case}.hlo.gz", "rt").read()
    rep = overlap.report(gpu_compile.Hlo.parse(text), row)
    t = rep["totals"]
    slim = {"totals": t, "per_kind": rep["per_kind"], "loops": rep["loops"],
            "device_row": {f: getattr(row, f, None) for f in ("link_bandwidth", "bandwidth", "peak_bf16_flops")}}
    suffix = ".orig" if os.environ.get("PREDICT_GROUPS") == "orig" else ""
    json.dump(slim, open(f"{P}/res/{case}.overlap{suffix}.json", "w"), indent=1)
    kinds = ", ".join(f"{k} {v['bytes']/G:.2f} GiB {v['seconds']*1e3:.1f} ms exp {v['exposed_seconds']*1e3:.1f} ms"
                      for k, v in rep["per_kind"].items())
    print(f"{case}: predicted step {t['predicted_step_seconds']:.3f} s = kernels {t['compute_seconds']:.3f} s + exposed "
          f"{t['exposed_seconds']*1e3:.1f} ms; collectives on the link {t['collective_seconds']*1e3:.1f} ms; "
          f"matmul {t['matmul_flops']/1e12:.1f} TFLOP | {kinds}", flush=True)


if __name__ == "__main__":
  main()
