"""What the vendor's datasheet promises a chip: the denominators of the report's ratios."""
from __future__ import annotations

import dataclasses

from jaxsys import metrics


@dataclasses.dataclass(frozen=True)
class Datasheet:
  """Dense peaks (the sparse figures are twice these) and HBM bandwidth of one chip."""
  device_kind: str
  bf16_flops: float
  int8_ops: float
  fp8_flops: float
  hbm_bytes_per_s: float
  source: str

  def peak(self, scheme: str) -> float:
    """The peak a matmul of `scheme` runs against: 8-bit tensor cores for W8A8, bf16 else
    (W4A16 dequantizes into bf16 before its dot)."""
    return {"w8a8_int8": self.int8_ops, "w8a8_fp8": self.fp8_flops}.get(scheme, self.bf16_flops)


def _nvidia(kind: str, eight_bit: float, hbm: float, part: str) -> Datasheet:
  return Datasheet(kind, metrics.DATASHEET_PEAK_FLOPS[kind], eight_bit, eight_bit, hbm,
                   f"NVIDIA {part} datasheet (dense tensor-core peaks, HBM bandwidth)")


SHEETS = {s.device_kind: s for s in (
    _nvidia("NVIDIA H200", 1979e12, 4.8e12, "H200 Tensor Core GPU, SXM"),
    _nvidia("NVIDIA H200 NVL", 1671e12, 4.8e12, "H200 Tensor Core GPU, NVL"),
    _nvidia("NVIDIA H100 80GB HBM3", 1979e12, 3.35e12, "H100 Tensor Core GPU, SXM5"),
    _nvidia("NVIDIA H100 PCIe", 1513e12, 2.0e12, "H100 Tensor Core GPU, PCIe"),
    _nvidia("NVIDIA H100 NVL", 1671e12, 3.9e12, "H100 Tensor Core GPU, NVL"),
)}


def lookup(device_kind: str) -> Datasheet | None:
  return SHEETS.get(device_kind)
