"""The one device table and the one lookup (`of`) of a device: its row and what kernels need.

Rows are the vendors' datasheet figures (dense bf16 and FP8, no sparsity); None where not known or none.
"""

from __future__ import annotations

import dataclasses

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Device:
  peak_bf16_flops: float | None
  memory_bytes: int | None
  bandwidth: float | None = None  # HBM bytes/s (the roofline of compile-only GPU targets)
  compute_capability: str | None = None  # CUDA GPUs
  link_bandwidth: float | None = None  # bytes/s one way per GPU to its node's peers (NVLink), for collectives
  peak_fp8_flops: float | None = None  # dense FP8 tensor cores (Hopper, Ada, Blackwell): the roofline of FP8 GEMMs


TABLE: dict[str, Device] = {
    "H200": Device(989e12, 141 * 10**9, 4.8e12, "9.0", 450e9, 1979e12),
    # SXM; the PCIe card is lower and reports "H100 PCIe"
    "H100": Device(989e12, 80 * GiB, 3.35e12, "9.0", 450e9, 1979e12),
    "H100 PCIe": Device(756e12, 80 * GiB, 2.0e12, "9.0", peak_fp8_flops=1513e12),
    "H100 NVL": Device(835e12, 94 * GiB, 3.9e12, "9.0", peak_fp8_flops=1671e12),
    "GH200": Device(989e12, 96 * GiB, None, "9.0", peak_fp8_flops=1979e12),
    "B200": Device(2250e12, 180 * 10**9, 8.0e12, "10.0", 900e9, 4500e12),
    "A100": Device(312e12, 80 * GiB, 2.039e12, "8.0", 300e9),  # 80GB SXM
    "A100-SXM4-40GB": Device(312e12, 40 * GiB, 1.555e12, "8.0"),
    "A100-PCIE-40GB": Device(312e12, 40 * GiB, 1.555e12, "8.0"),
    "L40S": Device(362e12, 48 * GiB, None, "8.9", peak_fp8_flops=733e12),
    "A10G": Device(70e12, 24 * GiB, None, "8.6"),
    "TPU v4": Device(275e12, 32 * GiB),
    "TPU v5 lite": Device(197e12, 16 * GiB),
    "TPU v5p": Device(459e12, 95 * GiB),
    "TPU v6 lite": Device(918e12, 32 * GiB),
}


@dataclasses.dataclass(frozen=True)
class Info:
  """A device as the analyses and the kernel choice see it."""
  kind: str                   # jax's device_kind, or the name given
  key: str | None             # the table row matched, None when none is
  platform: str               # cpu, gpu, tpu
  capability: tuple[int, int] = (0, 0)  # CUDA compute capability; (0, 0): not a CUDA GPU

  entry = property(lambda self: TABLE.get(self.key))
  cuda = property(lambda self: self.capability > (0, 0))
  max_head_dim = property(lambda self: 256 if self.capability >= (9, 0) else 128)  # cuDNN attention
  packed = property(lambda self: self.capability >= (9, 0))  # cuDNN's packed segment layout


def _capability(cc) -> tuple[int, int]:
  parts = str(cc or "").split(".")
  return (int(parts[0]), int(parts[1])) if len(parts) == 2 and all(p.isdigit() for p in parts) else (0, 0)


def of(device=None) -> Info:
  """A jax device (real or compile-only; None: the first local one), any object with its
  platform/compute_capability/device_kind, or a name the user gives ("H100", "A100-80GB").
  The row is the longest table key the kind contains, case-insensitively; never raises."""
  if device is None:
    import jax
    try:
      device = jax.devices()[0]
    except RuntimeError:
      return Info(jax.default_backend(), None, jax.default_backend())
  kind = device.strip() if isinstance(device, str) else str(getattr(device, "device_kind", ""))
  key = max((k for k in TABLE if k.lower() in kind.lower()), key=len, default=None)
  if isinstance(device, str):  # a target that is not here: what its row says
    cc = TABLE[key].compute_capability if key else None
    return Info(key or kind, key, "gpu" if cc else "tpu" if (key or "").startswith("TPU") else "cpu", _capability(cc))
  # CUDA devices report a numeric capability ("9.0"), ROCm a gfx name (not CUDA)
  cap = _capability(getattr(device, "compute_capability", "")) if device.platform == "gpu" else (0, 0)
  return Info(kind, key, device.platform, cap)


def peak_flops(device_kind: str) -> float | None:
  """Peak dense bf16 FLOP/s of a device kind from `TABLE` (the MFU denominator); None where unknown (e.g. CPU)."""
  entry = of(device_kind).entry
  return entry.peak_bf16_flops if entry else None
