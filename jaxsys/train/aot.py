"""A run's programs compiled ahead of time for a TPU slice, from a CPU host, and what they cost.

`compile_run(run, slice)` builds the run's setup (the same `make_setup` the runner uses) on
a mesh of the slice's devices (`jaxsys.chips.slice_devices`) and compiles its train step,
its evaluation step and, for replica runs, its outer sync. The kernels are chosen for the
slice (`sharded.under_mesh` targets the mesh's platform: the Mosaic TPU kernels under
`impl="pallas"` or `"auto"`). Each program's report is per device: the compiled memory
against the chip's HBM, FLOPs (the HLO's matmuls and Pallas kernels, every loop trip),
the HBM bytes its top-level instructions read and write (every loop trip; XLA's cost
analysis counts a loop body once), the bytes each kind of collective sends, and a roofline
lower bound on its time. The train step's recompute bound is model FLOPs / compiled FLOPs:
the fraction of its matmul work that is the model's, a bound that no chip changes.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp

from jaxsys import chips, comm_bytes, flops as flops_lib, hlo_flops
from jaxsys import mesh as mesh_lib
from jaxsys.config import RunConfig
from jaxsys.data.packing import FIELDS
from jaxsys.models import transformer
from jaxsys.train import comm_device
from jaxsys.train.setup import Setup, make_setup

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# How a Pallas kernel shows in compiled HLO: a Mosaic custom call (TPU) or a Triton one (GPU).
_KERNEL_CALLS = re.compile(r'custom_call_target="(?:tpu_custom_call|__gpu\$xla\.gpu\.triton)"')


@dataclasses.dataclass(frozen=True)
class Program:
  """One compiled program's cost on one device of `slice`."""
  name: str
  slice: chips.Slice
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  code_bytes: int
  flops: float  # the HLO's dots and Pallas kernels, loops counted in full
  kernel_flops: float  # of which the Pallas TPU kernels' (their own cost estimates)
  kernel_calls: int  # Pallas kernels in the program: Mosaic (TPU) or Triton (GPU) calls
  unknown_loops: int  # loops with FLOPs whose trip count is a value: counted once, so
  # `flops` is then a lower bound
  xla_flops: float  # cost_analysis (a loop body counted once); 0 where XLA gives none (GPU)
  bytes_accessed: float  # cost_analysis (a loop body counted once)
  hbm_bytes_accessed: float  # read and written by top-level instructions, loops in full
  collective_bytes: dict[str, int]  # sent per device, by kind, loops counted in full

  @property
  def peak_bytes(self) -> int:
    """HBM the program needs at once: arguments, outputs (less what they alias), temporaries
    and code."""
    return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
            + self.code_bytes)

  @property
  def hbm_bytes(self) -> float:
    return self.slice.per_device(self.slice.chip.hbm_bytes)

  @property
  def fits(self) -> bool:
    return self.peak_bytes <= self.hbm_bytes

  def bound_seconds(self) -> dict[str, float]:
    """Roofline lower bounds on the program's time: its matmuls at the bf16 peak, its HBM
    bytes (every loop trip) at HBM bandwidth, its collectives at the chip's whole ICI
    bandwidth."""
    chip, per = self.slice.chip, self.slice.per_device
    return {"compute": self.flops / per(chip.bf16_flops),
            "memory": self.hbm_bytes_accessed / per(chip.hbm_bandwidth),
            "ici": sum(self.collective_bytes.values()) / per(chip.ici_bandwidth)}

  @property
  def seconds(self) -> float:
    """The roofline lower bound: the slowest of `bound_seconds` (none overlaps another)."""
    return max(self.bound_seconds().values())


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


def _batch(run: RunConfig, sharding) -> dict:
  shape = (run.data.batch_size, run.data.seq_len)
  return {f: jax.ShapeDtypeStruct(shape, jnp.float32 if f == "loss_mask" else jnp.int32,
                                  sharding=sharding) for f in FIELDS}


def measure(name: str, compiled, slice_: chips.Slice) -> Program:
  """The per-device cost of a compiled program."""
  memory, cost = compiled.memory_analysis(), compiled.cost_analysis() or {}
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  hlo = compiled.as_text()
  sent = {kind: comm_bytes.collective_bytes_from_hlo(hlo, len(slice_.devices), trips=True,
                                                    kind=kind) for kind in COLLECTIVES}
  return Program(name, slice_, memory.argument_size_in_bytes, memory.output_size_in_bytes,
                 memory.alias_size_in_bytes, memory.temp_size_in_bytes,
                 memory.generated_code_size_in_bytes, hlo_flops.dot_flops(hlo),
                 hlo_flops.dot_flops(hlo, matmuls=False), len(_KERNEL_CALLS.findall(hlo)),
                 hlo_flops.loops_of_unknown_length(hlo),
                 float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)),
                 hlo_flops.hbm_bytes(hlo), {k: v for k, v in sent.items() if v})


@dataclasses.dataclass(frozen=True)
class Overflow:
  """A program the TPU compiler refused for want of HBM: what it said it needs."""
  name: str
  slice: chips.Slice
  needed_bytes: float
  available_bytes: float
  fits = False


# XLA:TPU's refusal: "... the total memory required for HLO temporaries (152.60G) exceeds
# available HBM (95.74G)."
_EXHAUSTED = re.compile(r"RESOURCE_EXHAUSTED.*?\(([\d.]+)([KMGT])\) exceeds available HBM "
                        r"\(([\d.]+)([KMGT])\)")
_UNITS = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def _compile(name: str, lowered, slice_: chips.Slice) -> Program | Overflow:
  """`lowered` compiled and measured, or the HBM it would need if it does not fit."""
  try:
    return measure(name, lowered.compile(), slice_)
  except jax.errors.JaxRuntimeError as e:
    found = _EXHAUSTED.search(str(e))
    if not found:
      raise
    return Overflow(name, slice_, float(found[1]) * _UNITS[found[2]],
                    float(found[3]) * _UNITS[found[4]])


def compile_run(run: RunConfig, slice_: chips.Slice
                ) -> tuple[Setup, list[Program | Overflow]]:
  """The run's setup on the slice and its compiled programs: train step, eval step and (with
  an outer optimizer) the outer sync."""
  mesh = mesh_lib.make_mesh(run.mesh, comm_device.training_devices(run.outer.comm_device,
                                                                   slice_.devices))
  setup = make_setup(run, mesh)
  state = _abstract(setup.abstract, setup.state_sh)
  if run.parallel.hdp:  # its update and a ring of 2 slots' micro-step, as a check builds them
    lowered = setup.train_fn.lower(state)
    programs = [_compile(f"train: {n}", lo, slice_)
                for n, lo in zip(("update", "micro-step"), lowered)]
  else:
    programs = [_compile("train step", setup.train_fn.lower(state, _batch(run, setup.batch_sh)),
                         slice_)]
  params = jax.eval_shape(setup.eval_params, state.params)  # the eval step lays them out
  programs.append(_compile("eval step", setup.eval_fn(jnp.ones(run.data.vocab_size)).lower(
      params, _batch(run, setup.batch_sh)), slice_))
  if setup.sync_fn is not None:
    programs.append(_compile("outer sync", setup.sync_fn.lower(state), slice_))
  return setup, programs


def model_flops_per_step(run: RunConfig, attention: bool = True) -> float:
  """6N + causal attention FLOPs of one training step over the whole batch (6N alone
  without `attention`)."""
  seq = run.data.seq_len
  per_token = transformer.train_flops_per_token(
      run.model, seq, pairs_per_row=flops_lib.attention_pairs(seq) if attention else 0)
  return per_token * run.data.batch_size * seq


def step_bound(run: RunConfig, train: Program) -> float:
  """A lower bound on the train step's time: its roofline, and never less than the model's
  own FLOPs at the slice's peak (what the compiled count misses in loops of unknown length)."""
  return max(train.seconds,
             model_flops_per_step(run) / (train.slice.chips * train.slice.chip.bf16_flops))


def recompute_bound(run: RunConfig, train: Program) -> float:
  """Model FLOPs (6N + causal attention) over the train step's compiled FLOPs on all
  devices: the MFU its recomputation and replicated work alone allow, whatever the chip.
  A bound, not a measurement: overlap, fusion and kernel speed are not in it."""
  return model_flops_per_step(run) / (train.flops * len(train.slice.devices))


# What makes a step need less HBM per chip, in the order it usually costs least.
_HELP = ("less would need: --config.model.remat=minimal, dots, qkv or full (recompute "
         "activations), --config.model.vocab_tiles=k (the logits in k tiles), "
         "--config.model.remat_offload=layer_input,q,k,v (keep them in host memory), a larger "
         "fsdp (or tensor, stage) axis, or --config.optimizer.grad_accum_steps=k (k "
         "microbatches a step)")


def summary(run: RunConfig, setup: Setup, programs: list[Program | Overflow]) -> dict:
  """The report's figures as plain data (per device; bytes, FLOPs, seconds), for tables."""
  s = programs[0].slice
  out = {"slice": s.name, "chips": s.chips, "devices": len(s.devices),
         "mesh": mesh_lib.describe(setup.mesh), "params": transformer.param_count(run.model),
         "tokens": run.data.batch_size * run.data.seq_len, "programs": {}}
  for p in programs:
    if isinstance(p, Overflow):
      out["programs"][p.name] = {"fits": False, "needed_bytes": p.needed_bytes,
                                 "hbm_bytes": p.available_bytes}
      continue
    out["programs"][p.name] = {
        "fits": p.fits, "peak_bytes": p.peak_bytes, "hbm_bytes": p.hbm_bytes,
        "temp_bytes": p.temp_bytes, "flops": p.flops, "kernel_flops": p.kernel_flops,
        "hbm_bytes_accessed": p.hbm_bytes_accessed,
        "unknown_loops": p.unknown_loops, "collective_bytes": p.collective_bytes,
        "seconds": p.seconds,
        "bound_seconds": p.bound_seconds()}
  train = programs[0]
  if isinstance(train, Program) and train.name == "train step":
    out["model_flops"] = model_flops_per_step(run)
    out["flops_over_model"] = train.flops * len(s.devices) / out["model_flops"]
    out["step_seconds"] = step_bound(run, train)
    out["recompute_bound"] = recompute_bound(run, train)
  return out


def _gib(n: float) -> str:
  """Bytes in GiB, or MiB / KiB where that reads better."""
  for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
    if abs(n) >= scale or unit == "KiB":
      return f"{n / scale:.2f} {unit}"


def report(run: RunConfig, setup: Setup, programs: list[Program]) -> str:
  """The programs' per-device costs as text."""
  first = programs[0]
  s, chip = first.slice, first.slice.chip
  lines = [f"slice {s.name}: {s.chips} chips, {len(s.devices)} devices "
           f"({s.devices_per_chip} per chip); mesh {mesh_lib.describe(setup.mesh)}",
           f"chip {chip.name}: {chip.bf16_flops / 1e12:.0f} TFLOP/s bf16, "
           f"{_gib(chip.hbm_bytes)} HBM at {chip.hbm_bandwidth / 1e9:.0f} GB/s, ICI "
           f"{chip.ici_bandwidth / 1e9:.0f} GB/s ({chip.source})",
           f"model: {transformer.param_count(run.model) / 1e9:.3f}B parameters; batch "
           f"{run.data.batch_size} x {run.data.seq_len} tokens"]
  for p in programs:
    if isinstance(p, Overflow):
      lines += [f"{p.name}, per device:",
                f"  DOES NOT FIT: the compiler needs {_gib(p.needed_bytes)} of HBM for "
                f"temporaries, the chip has {_gib(p.available_bytes)} "
                f"({_gib(p.needed_bytes - p.available_bytes)} over); {_HELP}"]
      continue
    verdict = ("fits" if p.fits else
               f"DOES NOT FIT: {_gib(p.peak_bytes - p.hbm_bytes)} over; {_HELP}")
    bound = p.bound_seconds()
    sent = ", ".join(f"{k} {_gib(v)}" for k, v in p.collective_bytes.items()) or "none"
    lines += [f"{p.name}, per device:",
              f"  memory {_gib(p.peak_bytes)} of {_gib(p.hbm_bytes)} ({verdict}): arguments "
              f"{_gib(p.argument_bytes)}, outputs {_gib(p.output_bytes)} (aliased "
              f"{_gib(p.alias_bytes)}), temporaries {_gib(p.temp_bytes)}, code "
              f"{_gib(p.code_bytes)}",
              f"  FLOPs {p.flops:.4g} (matmuls and Pallas kernels, loops in full; of "
              f"which kernels {p.kernel_flops:.4g}, {p.kernel_calls} kernel calls"
              + (f"; {p.unknown_loops} loops of unknown length counted once: a lower bound"
                 if p.unknown_loops else "") + "); "
              + (f"XLA cost analysis {p.xla_flops:.4g} FLOPs" if p.xla_flops else
                 "no XLA cost analysis for this target: Triton kernels' FLOPs are not counted"),
              f"  HBM bytes read and written {p.hbm_bytes_accessed:.4g} (loops in full"
              + (f"; XLA's cost analysis, a loop body once: {p.bytes_accessed:.4g})"
                 if p.bytes_accessed else ")"),
              f"  collectives sent: {sent}",
              f"  roofline: >= {p.seconds * 1e3:.2f} ms (compute {bound['compute'] * 1e3:.2f}, "
              f"HBM {bound['memory'] * 1e3:.2f}, ICI {bound['ici'] * 1e3:.2f})"]
  train = programs[0]
  if isinstance(train, Program) and train.name == "train step":
    model, six_n, n = model_flops_per_step(run), model_flops_per_step(run, False), len(s.devices)
    lines.append(f"train step: model FLOPs (6N + causal attention) {model:.4g}; compiled "
                 f"FLOPs x devices / model = {train.flops * n / model:.3f} (matmuls / "
                 f"6N = {(train.flops - train.kernel_flops) * n / six_n:.3f}); recompute "
                 f"bound {recompute_bound(run, train):.1%} (model / compiled FLOPs: the MFU "
                 "its recomputation allows on any chip; a bound, not a measurement)")
  return "\n".join(lines)
