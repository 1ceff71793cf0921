"""Which backends jax starts, chosen before it starts: the machine's accelerator, else the CPU.

Left to itself jax starts every backend it has a plugin for: on a host with no TPU, libtpu
(the `tpu` extra) writes its failed initialisation to stderr, and the CUDA plugin (the
`gpu-compile` extra) its missing driver, before a binary's first line. `choose()` names
only what this machine has in JAX_PLATFORMS, so a run starts cleanly on CPU, GPU and TPU
alike. This module imports nothing from jax: it runs before jax does, in every binary
(`experiments/__init__.py`, `jaxsys/cli/__init__.py`) and in a notebook's first cell
(`jaxsys.notebook.use_devices`).
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil

# Where a machine shows an accelerator before jax looks: a TPU VM's chips, Colab's TPU
# runtime, an NVIDIA driver (its device nodes or its /proc entry: a container may lack one).
_TPU_HINTS = ("/dev/accel0", "/dev/vfio/0")
_TPU_ENV = ("COLAB_TPU_ADDR", "TPU_NAME", "TPU_ACCELERATOR_TYPE")
_GPU_HINTS = ("/dev/nvidia0", "/dev/nvidiactl", "/proc/driver/nvidia/version")

# What `choose()` set JAX_PLATFORMS to, beside it in the environment (so a re-executed
# binary or a child process can tell it from the user's own choice, which is kept).
CHOSEN = "JAXSYS_CHOSEN_PLATFORMS"
_BY_ACCELERATOR = {"tpu": "tpu,cpu", "gpu": "cuda,cpu"}


def accelerator() -> str | None:
  """'tpu' or 'gpu' when this machine has one, else None (read without starting jax)."""
  if any(os.path.exists(p) for p in _TPU_HINTS) or any(os.environ.get(k) for k in _TPU_ENV):
    return "tpu"
  if any(os.path.exists(p) for p in _GPU_HINTS) or shutil.which("nvidia-smi"):
    return "gpu"
  return None


def has_plugin(found: str) -> bool:
  """Whether jax can start `found` ('tpu', 'gpu') here: libtpu, or jax's CUDA PJRT plugin,
  installed (found without importing them). Naming a backend jax has no plugin for would
  stop the run, where jax alone falls back to the CPU."""
  if found == "tpu":
    return "TPU_LIBRARY_PATH" in os.environ or importlib.util.find_spec("libtpu") is not None
  spec = importlib.util.find_spec("jax_plugins")
  return spec is not None and any(
      any(pathlib.Path(root).glob("xla_cuda*")) for root in spec.submodule_search_locations or ())


def user_set() -> bool:
  """Whether JAX_PLATFORMS was set by the user (empty included: jax then picks), not by
  `choose()` in this process or the one that started it."""
  return "JAX_PLATFORMS" in os.environ and os.environ["JAX_PLATFORMS"] != os.environ.get(CHOSEN)


def choose(platforms: str | None = None) -> str:
  """Sets JAX_PLATFORMS, before jax starts, unless the user set it: to `platforms` when
  given (a binary that compiles on the host passes "cpu"), else "tpu,cpu" on a TPU machine,
  "cuda,cpu" on an NVIDIA one (the CPU stays for host-side work), "cpu" otherwise.
  Returns JAX_PLATFORMS as jax will read it."""
  if user_set():
    return os.environ["JAX_PLATFORMS"]
  if platforms is None:
    found = accelerator()
    platforms = _BY_ACCELERATOR[found] if found and has_plugin(found) else "cpu"
  os.environ["JAX_PLATFORMS"] = os.environ[CHOSEN] = platforms
  return platforms
