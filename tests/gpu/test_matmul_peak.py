"""The measured bf16 matmul throughput (`analysis.speed.measure_peak`) against `devices.TABLE`."""


def test_measured_matmul_peak_is_below_the_datasheet(device, report):
  from jaxtrain.analysis import speed as bench
  from jaxtrain.parallel import devices
  m = bench.measure_peak(device)
  row = devices.of(device).entry
  table = row.peak_bf16_flops if row else None
  frac = m["flops"] / table if table else None
  report["matmul_peak"] = {**m, "device_kind": device.device_kind, "table_peak_flops": table,
                           "fraction_of_table": frac}
  print(f"matmul_peak: {m['tflops']:.4g} TFLOP/s (bf16 {m['size']}^3)"
        + (f" = {frac:.1%} of the table's {table / 1e12:.0f}" if frac else
           f"; device kind {device.device_kind!r} is not in jaxtrain.parallel.devices.TABLE"))
  assert m["flops"] > 0
  # The table holds the dense bf16 datasheet peak: a measurement above it means the wrong row
  # (e.g. a PCIe part read as SXM) or a timer that does not wait for the device.
  assert frac is None or frac <= 1.0, f"{m['tflops']:.4g} TFLOP/s measured > the table's {table / 1e12:.0f}"
