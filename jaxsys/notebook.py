"""What a notebook runs first, before jax starts: the devices it computes on.

Importing this module does not import jax, so a notebook's first cell can call
`use_devices()` before anything else starts a backend.
"""
from __future__ import annotations

from jaxsys import platforms, xla_flags
from jaxsys.platforms import accelerator  # pylint: disable=unused-import  # here before


def use_devices(cpu_devices: int = 8) -> str:
  """Computes on the machine's TPU or GPU when it has one, else on `cpu_devices` simulated
  CPU devices (so meshes of several devices work on a laptop or a CPU Colab runtime); only
  that backend starts (`platforms.choose`). Returns a line saying which; call it before jax
  starts."""
  found = platforms.accelerator()
  chosen = platforms.choose()
  if found is None or chosen == "cpu":
    xla_flags.default_cpu_devices(cpu_devices)
  import jax  # pylint: disable=import-outside-toplevel
  devices = jax.devices()
  if devices[0].platform != "cpu":
    why = ""
  elif found is None:
    why = " (simulated; no TPU or GPU found)"
  elif not platforms.has_plugin(found):
    why = f" (simulated; jax has no {found} plugin installed)"
  else:
    why = f" (simulated; JAX_PLATFORMS={chosen})"
  return f"jax {jax.__version__}: {len(devices)} {devices[0].platform} devices{why}"
