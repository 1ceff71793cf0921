"""Accelerator chips and slices: datasheet figures, and a slice's devices for compiling
without the accelerator.

`slice_devices("v5p-128")` gives the devices of a TPU slice from libtpu's topology
description (`jax.experimental.topologies`): `jax.jit(...).lower(...).compile()` on a mesh
of them builds that TPU's executable on a CPU host, with the real chip's memory use,
FLOPs and HLO. Slices are named as Cloud TPU names them (`v5p-128`: v4 and v5p count
TensorCores, two to a chip; v5e and v6e count chips) or by their shape (`v5p:4x4x4`).
`slice_devices("h100-8")` does the same for NVIDIA H100s (8 to a host) through the CUDA
PJRT plugin, given XLA's description of the GPU instead of a GPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import math
import os
import re


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU chip's datasheet figures (dense bf16 peak, HBM, ICI), and its source."""
  name: str
  device_kind: str  # jax.Device.device_kind
  bf16_flops: float  # FLOP/s, dense
  hbm_bytes: float
  hbm_bandwidth: float  # bytes/s
  ici_bandwidth: float  # bytes/s, bidirectional, all of a chip's links together
  torus_dims: int  # 2 (v5e, v6e) or 3 (v4, v5p); GPUs: 3 (slices x hosts x GPUs a host)
  cores_per_chip: int  # TensorCores: Cloud TPU names of v4 and v5p slices count these
  source: str
  platform: str = "tpu"
  target_config: str = ""  # GPUs: XLA's GpuTargetConfigProto (text), what a GPU would report


GB, GIB = 1e9, 2 ** 30
# XLA's description of an H100 SXM (xla/tools/hlo_opt/gpu_specs/h100_sxm.txtpb): what the
# CUDA plugin compiles for when no GPU is there to ask.
_H100_SXM = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84978434048 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
device_description_str: "NVIDIA H100 80GB HBM3"
"""
CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("v4", "TPU v4", 275e12, 32 * GIB, 1200 * GB, 300 * GB, 3, 2,
         "cloud.google.com/tpu/docs/v4 (peak, HBM); ICI: 6 links x 50 GB/s, Jouppi et al., "
         "'TPU v4: An Optically Reconfigurable Supercomputer', ISCA 2023"),
    Chip("v5e", "TPU v5 lite", 197e12, 16 * GB, 819 * GB, 400 * GB, 2, 1,
         "cloud.google.com/tpu/docs/v5e"),
    Chip("v5p", "TPU v5", 459e12, 95 * GIB, 2765 * GB, 1200 * GB, 3, 2,
         "cloud.google.com/tpu/docs/v5p"),
    Chip("v6e", "TPU v6 lite", 918e12, 32 * GB, 1638 * GB, 800 * GB, 2, 1,
         "cloud.google.com/tpu/docs/v6e"),
    # Within a host (NVLink); across hosts a GPU has 400 Gb/s of InfiniBand, 18x less.
    Chip("h100", "NVIDIA H100 80GB HBM3", 989.4e12, 84_978_434_048, 3352 * GB, 900 * GB, 3, 1,
         "NVIDIA H100 Tensor Core GPU datasheet, SXM5 (dense bf16, HBM3, NVLink 4); HBM size "
         "and bandwidth as XLA's gpu_specs/h100_sxm.txtpb", platform="gpu",
         target_config=_H100_SXM),
)}

# The slice shapes Cloud TPU offers by chip count (the first one listed for a count).
_SHAPES_2D = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
              256: "16x16"}
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
              256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
INSTALL = "pip install 'jax[tpu]' (brings libtpu; or pip install -e '.[tpu]')"
INSTALL_GPU = ("pip install jax-cuda12-pjrt==<your jax version> (or -cuda13-: the CUDA PJRT plugin, no CUDA "
               "libraries; pip install -e '.[gpu-compile]' for jax 0.10.2)")
_GPUS_PER_HOST = 8


@dataclasses.dataclass(frozen=True)
class Slice:
  """A TPU slice: its chip, its shape (`4x4x4`) and the devices jax sees in it."""
  chip: Chip
  shape: str
  devices: tuple

  @property
  def chips(self) -> int:
    return math.prod(int(n) for n in self.shape.split("x"))

  @property
  def name(self) -> str:
    return f"{self.chip.name}:{self.shape}"

  @property
  def devices_per_chip(self) -> int:
    return len(self.devices) // self.chips

  def per_device(self, figure: float) -> float:
    """A per-chip figure's share of one device (v4 shows each TensorCore as a device)."""
    return figure / self.devices_per_chip


def valid_names() -> str:
  """The slice names this module takes, for an error message."""
  return ("<chip>-<n> or <chip>:<shape> with chip one of " + ", ".join(CHIPS)
          + " (e.g. v5e-8, v5p-128, v6e:4x4, v4:2x2x2, h100-8, h100-16)")


def parse(name: str) -> tuple[Chip, str]:
  """(chip, shape) of a slice name; a ValueError naming what is valid otherwise."""
  match = re.fullmatch(r"(v\d[a-z]?|h100)(?:-(\d+)|:(\d+(?:x\d+)+))", str(name).strip().lower())
  chip = CHIPS.get(match[1]) if match else None
  if chip is None:
    raise ValueError(f"topology={name!r} is not a TPU slice; it must be {valid_names()}")
  if match[3]:
    dims = match[3].split("x")
    if len(dims) != chip.torus_dims:
      raise ValueError(f"topology={name!r}: a {chip.name} shape has {chip.torus_dims} "
                       f"dimensions (e.g. {chip.name}:{_shapes(chip)[8]})")
    return chip, match[3]
  n = int(match[2])
  chips, rest = divmod(n, chip.cores_per_chip)
  shape = _shapes(chip).get(chips) if not rest else None
  if shape is None:
    counts = ", ".join(f"{chip.name}-{c * chip.cores_per_chip}" for c in _shapes(chip))
    offers = "GPU count jaxsys knows" if chip.platform == "gpu" else "slice Cloud TPU offers"
    raise ValueError(f"topology={name!r} is not a {chip.name} {offers}; valid: "
                     f"{counts}, or a shape such as {chip.name}:{_shapes(chip)[8]}")
  return chip, shape


def _shapes(chip: Chip) -> dict[int, str]:
  if chip.platform == "gpu":  # 1 slice x hosts x GPUs a host
    return {n: f"1x{max(1, n // _GPUS_PER_HOST)}x{min(n, _GPUS_PER_HOST)}"
            for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
  return _SHAPES_3D if chip.torus_dims == 3 else _SHAPES_2D


def wraparound(chip: Chip, shape: str) -> tuple[bool, bool, bool]:
  """Which of the slice's dimensions close into a ring, as Cloud TPU builds them: a v4 or
  v5p slice of whole 4x4x4 cubes is a torus in all three (its optical switches close
  them), smaller ones in none; a v5e or v6e dimension of 16 chips (the pod's width) closes.
  libtpu needs it said: without it a 64-chip `fsdp` gather compiles as an all-reduce of a
  zero-padded buffer (2x the bytes) where the torus's is an all-gather
  (docs/results/tpu_compile.md)."""
  dims = [int(d) for d in shape.split("x")]
  if chip.torus_dims == 3:
    return (all(d % 4 == 0 for d in dims),) * 3
  return tuple(d == 16 for d in dims) + (False,)


def slice_devices(name: str) -> Slice:
  """The slice `name` with its devices from libtpu, no TPU needed. ValueError: an unknown
  name, or a shape libtpu refuses; RuntimeError: libtpu is not installed."""
  chip, shape = parse(name)
  if chip.platform == "gpu":
    return _gpu_slice(name, chip, shape)
  try:
    import libtpu  # noqa: F401 pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    raise RuntimeError(f"compiling for TPU needs libtpu, which is not installed: {INSTALL}"
                       ) from None
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    with _tpu_host_environment():
      topology = topologies.get_topology_desc(platform="tpu",
                                              topology_name=f"{chip.name}:{shape}",
                                              wrap=wraparound(chip, shape))
  except Exception as e:  # pylint: disable=broad-except  (libtpu raises XlaRuntimeError)
    raise ValueError(f"topology={name!r}: libtpu refuses the shape {shape} ({_first_line(e)})") from None
  return Slice(chip, shape, tuple(topology.devices))


# A host that is not a TPU VM: no metadata server to ask, and this host's own (made-up)
# accelerator and worker, so libtpu starts without warnings; only a description is
# loaded, so several processes (test workers) may load libtpu at once.
_TPU_HOST = (("TPU_SKIP_MDS_QUERY", "1"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
             ("TPU_ACCELERATOR_TYPE", "v5litepod-8"), ("TPU_WORKER_HOSTNAMES", "localhost"),
             ("TPU_WORKER_ID", "0"))


@contextlib.contextmanager
def _tpu_host_environment():
  """`_TPU_HOST`'s variables (where unset) while libtpu loads, removed after: a process this
  one starts later must not inherit TPU_WORKER_HOSTNAMES and take itself for a worker of a
  multi-host TPU run (the trainer joins one when that variable is set)."""
  added = [key for key, _ in _TPU_HOST if key not in os.environ]
  os.environ.update({key: value for key, value in _TPU_HOST if key in added})
  try:
    yield
  finally:
    for key in added:
      os.environ.pop(key, None)


def _gpu_slice(name: str, chip: Chip, shape: str) -> Slice:
  """The GPUs of `shape` (slices x hosts x GPUs a host) from the CUDA plugin, no GPU needed."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  plugin = _cuda_plugin()
  if plugin is None:
    raise RuntimeError(f"compiling for {chip.name} needs jax's CUDA plugin, which is not "
                       f"installed: {INSTALL_GPU}")
  if plugin[1] != jax.__version__:
    raise RuntimeError(f"{plugin[0]} {plugin[1]} is not the installed jax's ({jax.__version__}): "
                       f"pip install {plugin[0]}=={jax.__version__}")
  try:
    topology = topologies.get_topology_desc(chip.name, platform="cuda", topology=shape,
                                            target_config=chip.target_config)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"topology={name!r}: the CUDA plugin refuses the shape {shape} ({_first_line(e)})"
                     ) from None
  return Slice(chip, shape, tuple(topology.devices))


def _cuda_plugin() -> tuple[str, str] | None:
  """(distribution, version) of jax's CUDA PJRT plugin, CUDA 13's or 12's, if installed."""
  for cuda in ("13", "12"):
    try:
      importlib.import_module(f"jax_plugins.xla_cuda{cuda}")
      return f"jax-cuda{cuda}-pjrt", importlib.metadata.version(f"jax-cuda{cuda}-pjrt")
    except (ImportError, importlib.metadata.PackageNotFoundError):
      continue
  return None


def _first_line(error: Exception) -> str:
  """A plugin's refusal in one line (its message's first, or the error's type)."""
  text = str(error).strip()
  return text.splitlines()[0] if text else type(error).__name__
