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
  compute_capability: str | None = None  # CUDA GPUs: what the attention kernel choice needs


TABLE: dict[str, Device] = {
    "H200": Device(989e12, 141 * 10**9, 4.8e12, "9.0"),
    "H100": Device(989e12, 80 * GiB, 3.35e12, "9.0"),  # SXM; the PCIe card is lower and reports "H100 PCIe"
    "H100 PCIe": Device(756e12, 80 * GiB, 2.0e12, "9.0"),
    "H100 NVL": Device(835e12, 94 * GiB, 3.9e12, "9.0"),
    "GH200": Device(989e12, 96 * GiB, None, "9.0"),
    "B200": Device(2250e12, 180 * 10**9, 8.0e12, "10.0"),
    "A100": Device(312e12, 80 * GiB, 2.039e12, "8.0"),  # 80GB SXM
    "A100-SXM4-40GB": Device(312e12, 40 * GiB, 1.555e12, "8.0"),
    "A100-PCIE-40GB": Device(312e12, 40 * GiB, 1.555e12, "8.0"),
    "L40S": Device(362e12, 48 * GiB, None, "8.9"),
    "A10G": Device(70e12, 24 * GiB, None, "8.6"),
    "TPU v4": Device(275e12, 32 * GiB),
    "TPU v5 lite": Device(197e12, 16 * GiB),
    "TPU v5p": Device(459e12, 95 * GiB),
    "TPU v6 lite": Device(918e12, 32 * GiB),
}


def lookup(kind: str) -> Device | None:
  """The entry whose key is the longest one contained in `kind`; None when none is."""
  hits = [k for k in TABLE if k.lower() in kind.lower()]
  return TABLE[max(hits, key=len)] if hits else None


def named(name: str) -> tuple[str, Device]:
  """(table key, entry) for a device name the user gives (`--device H100`, `A100-80GB`):
  a key, case-insensitively, else the longest key it contains; a UserError listing the keys."""
  from jaxtrain.core.errors import UserError
  text = name.strip()
  key = {k.lower(): k for k in TABLE}.get(text.lower())
  if key is None:
    hits = [k for k in TABLE if k.lower() in text.lower()]
    key = max(hits, key=len) if hits else None
  if key is None:
    raise UserError(f"--device {name!r} is not a known device; known: {', '.join(TABLE)}")
  return key, TABLE[key]


def stand_in(name: str):
  """An object with what the attention kernel choice reads of a device (platform,
  compute_capability, device_kind), for a target device that is not here."""
  import types
  key, entry = named(name)
  platform = "gpu" if entry.compute_capability else ("tpu" if key.startswith("TPU") else "cpu")
  return types.SimpleNamespace(platform=platform, compute_capability=entry.compute_capability or "", device_kind=key)
