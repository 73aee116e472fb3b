"""The one device table: peak dense bf16 FLOP/s, memory and memory bandwidth per device kind.

A device kind (jax's `device.device_kind`, or a name the user gives such as "H100") is
matched by the longest table key it contains, case-insensitively. Figures are the vendors'
datasheet numbers (dense, no sparsity); None where a figure is not known.
"""

from __future__ import annotations

import dataclasses

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Device:
  peak_bf16_flops: float | None
  memory_bytes: int | None
  bandwidth: float | None = None  # HBM bytes/s (the roofline of compile-only GPU targets)


TABLE: dict[str, Device] = {
    "H200": Device(989e12, 141 * 10**9, 4.8e12),
    "H100": Device(989e12, 80 * GiB, 3.35e12),  # SXM; the PCIe card is lower and reports "H100 PCIe"
    "H100 PCIe": Device(756e12, 80 * GiB, 2.0e12),
    "H100 NVL": Device(835e12, 94 * GiB, 3.9e12),
    "GH200": Device(989e12, 96 * GiB),
    "B200": Device(2250e12, 180 * 10**9, 8.0e12),
    "A100": Device(312e12, 80 * GiB, 2.039e12),  # 80GB SXM
    "A100-SXM4-40GB": Device(312e12, 40 * GiB, 1.555e12),
    "A100-PCIE-40GB": Device(312e12, 40 * GiB, 1.555e12),
    "L40S": Device(362e12, 48 * GiB),
    "A10G": Device(70e12, 24 * GiB),
    "TPU v4": Device(275e12, 32 * GiB),
    "TPU v5 lite": Device(197e12, 16 * GiB),
    "TPU v5p": Device(459e12, 95 * GiB),
    "TPU v6 lite": Device(918e12, 32 * GiB),
}


def lookup(kind: str) -> Device | None:
  """The entry whose key is the longest one contained in `kind`; None when none is."""
  hits = [k for k in TABLE if k.lower() in kind.lower()]
  return TABLE[max(hits, key=len)] if hits else None
