"""Which kernel implementation runs where, and Pallas' backend parameters by the names
of the installed jax (they moved between 0.10 and 0.11)."""
from __future__ import annotations

import jax
from jax.experimental import pallas as pl

IMPLS = ("auto", "pallas", "xla", "reference")

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


def resolve_impl(who: str, impl: str, backend: str | None = None) -> str:
  """"auto" -> the fastest path for the backend: Pallas on GPU and TPU, XLA on CPU."""
  if impl not in IMPLS:
    raise ValueError(f"{who}: impl={impl!r} is not available; choose one of {IMPLS}")
  if impl != "auto":
    return impl
  return "xla" if (backend or jax.default_backend()) == "cpu" else "pallas"


def triton_params(interpret, **kw):
  """Triton compiler parameters, or None in interpret mode.

  Always passed when compiling: without them jax 0.10 lowers a GPU pallas_call through
  Mosaic GPU, which lacks rules these kernels need (dot_general).
  """
  if interpret or TritonParams is None:
    return None
  return TritonParams(**kw)
