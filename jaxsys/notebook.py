"""What a notebook runs first, before jax starts: the devices it computes on.

Importing this module does not import jax, so a notebook's first cell can call
`use_devices()` before anything else starts a backend.
"""
from __future__ import annotations

import os
import shutil

from jaxsys import xla_flags

# Where a machine shows an accelerator before jax looks: a TPU VM's chips, Colab's TPU
# runtime, an NVIDIA driver.
_TPU_HINTS = ("/dev/accel0", "/dev/vfio/0")
_TPU_ENV = ("COLAB_TPU_ADDR", "TPU_NAME", "TPU_ACCELERATOR_TYPE")


def accelerator() -> str | None:
  """'tpu' or 'gpu' when this machine has one, else None (read without starting jax)."""
  if any(os.path.exists(p) for p in _TPU_HINTS) or any(os.environ.get(k) for k in _TPU_ENV):
    return "tpu"
  if os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi"):
    return "gpu"
  return None


def use_devices(cpu_devices: int = 8) -> str:
  """Computes on the machine's TPU or GPU when it has one, else on `cpu_devices` simulated
  CPU devices (so meshes of several devices work on a laptop or a CPU Colab runtime).
  Returns a line saying which; call it before jax starts."""
  found = accelerator()
  if found is None:
    xla_flags.default_cpu_devices(cpu_devices)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax  # pylint: disable=import-outside-toplevel
  devices = jax.devices()
  return (f"jax {jax.__version__}: {len(devices)} {devices[0].platform} devices"
          + ("" if found else " (simulated; no TPU or GPU found)"))
