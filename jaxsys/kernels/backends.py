"""Which kernel implementation runs where, and Pallas' backend parameters by the names
of the installed jax (they moved between 0.10 and 0.11)."""
from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.experimental import pallas as pl

IMPLS = ("auto", "pallas", "xla", "reference")
FLAVORS = ("gpu", "tpu")  # Pallas kernel families: Triton (GPU) and Mosaic (TPU)
_FLAVOR_NAMES = {"gpu": "GPU (Triton)", "tpu": "TPU (Mosaic)"}

try:
  from jax.experimental.pallas import triton as _pl_triton
  TritonParams = getattr(_pl_triton, "CompilerParams", None) or getattr(
      _pl_triton, "TritonCompilerParams")
except ImportError:  # pragma: no cover - jax without the Triton Pallas backend
  TritonParams = None

try:
  from jax.experimental.pallas import tpu as pltpu
  TpuParams = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
  TpuInterpretParams = getattr(pltpu, "InterpretParams", None)
  PARALLEL = getattr(pltpu, "PARALLEL", "parallel")
  ARBITRARY = getattr(pltpu, "ARBITRARY", "arbitrary")
except ImportError:  # pragma: no cover - jax without the Mosaic Pallas backend
  pltpu = TpuParams = TpuInterpretParams = None
  PARALLEL, ARBITRARY = "parallel", "arbitrary"

SQUEEZED = getattr(pl, "squeezed", None)  # `None` in a block shape means the same

# The platform being compiled for, while a step is traced for a mesh (`targeting`): a TPU
# slice's devices on a CPU host make it "tpu" while jax's default backend stays "cpu".
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxsys_target",
                                                                   default=None)


def platform() -> str:
  """The platform kernels are chosen for: the compile target, else jax's default backend."""
  return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def targeting(target: str):
  """Chooses kernels for `target` ("cpu", "gpu", "tpu") inside the block."""
  token = _TARGET.set(target)
  try:
    yield
  finally:
    _TARGET.reset(token)


def resolve_impl(who: str, impl: str, backend: str | None = None) -> str:
  """"auto" -> the fastest path for the backend: Pallas on GPU and TPU, XLA on CPU."""
  if impl not in IMPLS:
    raise ValueError(f"{who}: impl={impl!r} is not available; choose one of {IMPLS}")
  if impl != "auto":
    return impl
  return "xla" if (backend or platform()) == "cpu" else "pallas"


def pallas_flavor(who: str, flavor: str | None = None, backend: str | None = None) -> str:
  """None -> "tpu" on a TPU backend, "gpu" elsewhere; a given flavor is checked."""
  if flavor is None:
    return "tpu" if (backend or platform()) == "tpu" else "gpu"
  if flavor not in FLAVORS:
    raise ValueError(f"{who}: flavor={flavor!r} is not known; choose one of {FLAVORS}")
  return flavor


def resolve_interpret(who: str, flavor: str, interpret, backend: str | None = None):
  """The `interpret` argument for a `flavor` kernel's `pl.pallas_call`.

  None: compiled on the flavor's own backend, Pallas' generic interpreter on CPU, and an
  error on the other accelerator (interpreting there would be silently slow). False always
  compiles (e.g. `jax.export` for GPU or TPU from a CPU host); True interprets; the TPU
  flavor also takes a `pltpu.InterpretParams` (simulated VMEM, block pipeline, grid order).
  """
  backend = backend or platform()
  if interpret is None:
    if backend == "cpu":
      return True
    if (flavor == "tpu") != (backend == "tpu"):
      raise NotImplementedError(
          f"{who}: the {_FLAVOR_NAMES[flavor]} kernels do not compile on a {backend.upper()} "
          "backend; pass interpret=True to run them in interpret mode")
    return False
  if isinstance(interpret, bool) or (flavor == "tpu" and TpuInterpretParams is not None
                                     and isinstance(interpret, TpuInterpretParams)):
    return interpret
  valid = "None, True, False" + (" or a pltpu.InterpretParams" if flavor == "tpu" else "")
  raise ValueError(f"{who}: interpret={interpret!r} is not valid; pass {valid}")


def triton_params(interpret, **kw):
  """Triton compiler parameters, or None in interpret mode.

  Always passed when compiling: without them jax 0.10 lowers a GPU pallas_call through
  Mosaic GPU, which lacks rules these kernels need (dot_general).
  """
  if interpret or TritonParams is None:
    return None
  return TritonParams(**kw)
