r"""MaxText's train step for the same work, compiled for a TPU slice on this host and counted
with jaxsys's counters: the library of `experiments/maxtext_compile.py` (the side-by-side of
`python -m experiments.compile`), which runs in a MaxText venv of its own (jax 0.12.0.1,
libtpu 0.0.50.1): this module imports nothing but the standard library until
`compile_case`, which imports jax, MaxText and jaxsys's counters.

The cases (`CASES`): Llama-3-8B, 128 x 8192 tokens, `v5p-128`, fsdp=64, bf16 compute with
MaxText's f32 weights, flash attention; full remat (`v5p128_full`) or
`minimal_with_context` (`v5p128_minimal`: MaxText's scanned decoder rematerializes in full
even under `remat_policy=none`, so this is its nearest to remat off). `v6e256_recipe` is
MaxText's tuned Llama 3.1 8B recipe for `v6e-256` (1024 x 8192 tokens, q/k/v/out
projections and layer inputs offloaded to the host), copied from the MaxText repository's
`benchmarks/maxtext_trillium_model_configs.py` (`llama3_1_8b_8192`) and its XLA flags from
`benchmarks/xla_flags_library.py` (both as of AI-Hypercomputer/maxtext e591f30), set in
LIBTPU_INIT_ARGS as MaxText's benchmark runner sets them, with the continuation fusion
libtpu 0.0.50.1 refuses on v6e turned off (`_NOT_ON_V6E`); the recipe has no gradient
accumulation (add it with `--set=gradient_accumulation_steps=k`).

The program is MaxText's own: `maxtext.trainers.pre_train.train_compile.main`, with its
`jit_and_compile` wrapped to keep the compiled object and time it. It is measured by
`jaxsys.train.aot.measure`, exactly as jaxsys's programs are (memory analysis; matmul FLOPs
from the HLO with every loop trip; collective bytes sent per device by kind), and the JSON
has `aot.summary`'s fields for the train step, the host memory, and the compile's wall and
CPU seconds. Two things to know when reading it beside jaxsys's: MaxText's splash attention
kernels declare no cost, so its `flops` are its matmuls only (`kernel_calls_without_cost`
says how many kernel calls are left out; jaxsys's count includes its attention kernels'),
and MaxText describes its slices with their wraparound links (`v5p-128`: a 4x4x4 torus,
its `accelerator_to_spec_map`), which is why its fsdp=64 weight gathers compile to
all-gathers: libtpu (0.0.42 and 0.0.50) lowers them as all-reduces on a slice described
without wraparound.
"""
from __future__ import annotations

import importlib.metadata
import inspect
import os
import time

MAXTEXT_VERSION = "0.2.5"
INSTALL = ("/root/.pyenv/versions/3.12.1/bin/python -m venv /tmp/mt312 && /tmp/mt312/bin/pip "
           f"install 'maxtext[tpu]=={MAXTEXT_VERSION}' && /tmp/mt312/bin/pip install "
           "'jax[tpu]==0.12.0.1' 'libtpu==0.0.50.1', then run this file with /tmp/mt312/bin/python")

# MaxText's recipe flags (benchmarks/xla_flags_library.py, as `llama3_1_8b_8192` adds them).
_DENSE_VMEM_LIMIT_FLAG = " --xla_tpu_scoped_vmem_limit_kib=98304"
_LAYOUT_FOR_ALL_REDUCE_SCATTER = (" --xla_tpu_use_minor_sharding_for_major_trivial_input=true"
                                  " --xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1"
                                  " --xla_tpu_assign_all_reduce_scatter_layout=true")
_DATA_PARALLEL_OVERLAP = (" --xla_tpu_enable_data_parallel_all_reduce_opt=true"
                          " --xla_tpu_data_parallel_opt_different_sized_ops=true")
_CF_FOR_ALL_GATHER = (" --xla_tpu_enable_async_collective_fusion=true"
                      " --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"
                      " --xla_tpu_enable_async_collective_fusion_multiple_steps=true"
                      " --xla_tpu_overlap_compute_collective_tc=true"
                      " --xla_enable_async_all_gather=true")
_SPARSECORE_FOR_ALL_REDUCE = (" --xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false"
                              " --xla_tpu_enable_sparse_core_collective_offload_all_reduce=true"
                              " --xla_tpu_enable_all_reduce_offload_tracing=true"
                              " --xla_tpu_use_tc_device_shape_on_sc=true"
                              " --xla_sc_enable_instruction_fusion=false"
                              " --xla_sc_disjoint_spmem=false"
                              " --xla_sc_disable_megacore_partitioning=true")
_HOST_OFFLOAD_FLAGS = (" --xla_tpu_enable_all_experimental_scheduler_features=true"
                       " --xla_tpu_enable_scheduler_memory_pressure_tracking=true"
                       " --xla_tpu_host_transfer_overlap_limit=24"
                       " --xla_tpu_aggressive_opt_barrier_removal=ENABLED"
                       " --xla_lhs_prioritize_async_depth_over_stall=ENABLED"
                       " --xla_tpu_enable_ag_backward_pipelining=true"
                       " --xla_should_allow_loop_variant_parameter_in_chain=ENABLED"
                       " --xla_should_add_loop_invariant_op_in_chain=ENABLED"
                       " --xla_max_concurrent_host_send_recv=100"
                       " --xla_tpu_scheduler_percent_shared_memory_limit=100"
                       " --xla_latency_hiding_scheduler_rerun=2")

# libtpu 0.0.50.1 refuses the recipe's continuation fusion for all-gathers on v6e
# ("not supported/recommended on platforms other than TPU v5e ... Please disable it with
# xla_tpu_enable_async_collective_fusion=false"): turned off after the recipe's flags.
_NOT_ON_V6E = " --xla_tpu_enable_async_collective_fusion=false"

# jaxsys's llama3 8B compile: 128 x 8192 tokens on v5p-128 (64 chips), one fsdp axis.
_V5P128 = {"compile_topology": "v5p-128", "model_name": "llama3-8b", "max_target_length": 8192,
           "ici_fsdp_parallelism": -1, "attention": "flash", "per_device_batch_size": 2}
# benchmarks/maxtext_trillium_model_configs.py, `llama3_1_8b_8192` (tuning_params), less
# what does not change the program (dataset path, profiler, metrics to GCS).
_V6E256_RECIPE = {
    "compile_topology": "v6e-256", "model_name": "llama3.1-8b", "per_device_batch_size": 4,
    "ici_fsdp_parallelism": -1, "remat_policy": "custom", "decoder_layer_input": "offload",
    "out_proj": "offload", "query_proj": "offload", "key_proj": "offload",
    "value_proj": "offload", "max_target_length": 8192, "attention": "flash",
    "use_iota_embed": True, "sa_block_q": 2048, "sa_block_kv": 2048,
    "sa_block_kv_compute": 2048, "sa_block_q_dkv": 2048, "sa_block_kv_dkv": 2048,
    "sa_block_kv_dkv_compute": 2048, "sa_block_q_dq": 2048, "sa_block_kv_dq": 2048,
    "sa_use_fused_bwd_kernel": True}
CASES = {"v5p128_full": _V5P128 | {"remat_policy": "full"},
         "v5p128_minimal": _V5P128 | {"remat_policy": "minimal_with_context"},
         "v6e256_recipe": _V6E256_RECIPE}
# The recipe's XLA flags go where MaxText's benchmark runner puts them
# (benchmarks/maxtext_xpk_runner.py: LIBTPU_INIT_ARGS='{xla_flags}'), not into
# train_compile's compile_xla_flags: some (--xla_sc_*) are libtpu's, not compile options.
LIBTPU_FLAGS = {"v6e256_recipe": (_DENSE_VMEM_LIMIT_FLAG + _LAYOUT_FOR_ALL_REDUCE_SCATTER
                                  + _DATA_PARALLEL_OVERLAP + _CF_FOR_ALL_GATHER
                                  + _SPARSECORE_FOR_ALL_REDUCE + _HOST_OFFLOAD_FLAGS
                                  + _NOT_ON_V6E).strip()}
# Every case: synthetic data, no checkpoints, nothing written but the compile.
_COMMON = {"run_name": "maxtext_compile", "base_output_directory": "/tmp/maxtext_compile",
           "dataset_type": "synthetic", "enable_checkpointing": False,
           "compile_topology_num_slices": 1}


def installed_version() -> str | None:
  """The maxtext distribution's version in this python, or None."""
  try:
    return importlib.metadata.version("maxtext")
  except importlib.metadata.PackageNotFoundError:
    return None


def maxtext_argv(case: str, overrides=(), base: str | None = None) -> list[str]:
  """train_compile's argv: `base` (default: the installed package's configs/base.yml),
  then the case's key=value settings and `overrides` (key=value strings, later ones
  winning). ValueError: an override without `=`."""
  settings = _COMMON | CASES[case]
  for item in overrides:
    key, eq, value = item.partition("=")
    if not eq or not key:
      raise ValueError(f"--set={item!r}: expected key=value")
    settings[key] = value
  if base is None:
    import maxtext  # pylint: disable=import-outside-toplevel
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  text = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # yaml's booleans
  return ["train_compile", base] + [f"{k}={text(v)}" for k, v in settings.items()]


def _param_count(state) -> int | None:
  """The model's parameters in MaxText's abstract train state (its `model` part)."""
  import jax  # pylint: disable=import-outside-toplevel
  try:
    model = state["model"] if "model" in state else state.model
    return int(sum(x.size for x in jax.tree.leaves(model) if hasattr(x, "size")))
  except (TypeError, AttributeError, KeyError):
    return None


_KERNEL_CALL = 'custom_call_target="tpu_custom_call"'


def compile_case(case: str, overrides=(), hlo_path: str | None = None) -> dict:
  """MaxText's train step for `case`, compiled: its figures as `aot.summary` gives a
  program's (the compiled HLO text written to `hlo_path` first, when given)."""
  # Before jax loads: the host compiles for a described slice, with no metadata server.
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  # Only a description of the slice is loaded: other processes (a jaxsys compile beside
  # this one) may hold libtpu's lockfile.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  if case in LIBTPU_FLAGS:
    os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") + " "
                                      + LIBTPU_FLAGS[case]).strip()
  from jaxsys import platforms  # pylint: disable=import-outside-toplevel
  platforms.choose("cpu")  # the user's JAX_PLATFORMS kept
  import jax  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train_compile  # pylint: disable=import-outside-toplevel
  from jaxsys import chips, hlo_flops  # pylint: disable=import-outside-toplevel
  from jaxsys.train import aot  # pylint: disable=import-outside-toplevel

  argv = maxtext_argv(case, overrides)
  kept = {}
  original = train_compile.jit_and_compile

  def timed(*args, **kwargs):
    # Lowering and compiling: what jaxsys's compile_seconds times too (with its setup and
    # its eval step's compile besides).
    bound = inspect.signature(original).bind(*args, **kwargs).arguments
    wall, cpu = time.perf_counter(), time.process_time()
    compiled = original(*args, **kwargs)
    kept.update(compiled=compiled, mesh=bound["mesh"], state=bound["func_input_args"][0],
                config=bound["config"], wall=time.perf_counter() - wall,
                cpu=time.process_time() - cpu)
    return compiled

  train_compile.jit_and_compile = timed
  wall, cpu = time.perf_counter(), time.process_time()
  try:
    train_compile.main(argv)
  finally:
    train_compile.jit_and_compile = original
  total_wall, total_cpu = time.perf_counter() - wall, time.process_time() - cpu
  if hlo_path:
    with open(hlo_path, "w", encoding="utf-8") as f:
      f.write(kept["compiled"].as_text())
  # The slice as jaxsys names it, for its HBM and device count (MaxText's own topology
  # call made the devices the program was compiled for).
  settings = dict(a.partition("=")[::2] for a in argv[2:])
  slice_ = chips.slice_devices(settings["compile_topology"])
  compiled = kept["compiled"]
  program = aot.measure("train step", compiled, slice_)
  # MaxText's splash attention kernels carry no cost estimate, so `flops` leaves their
  # FLOPs out (jaxsys's flash kernels declare theirs): how many calls that is.
  bodies, _ = hlo_flops.computations(compiled.as_text())
  uncounted = sum(1 for lines in bodies.values() for line in lines
                  if _KERNEL_CALL in line and '"cost_estimate"' not in line)
  mesh, memory = kept["mesh"], compiled.memory_analysis()
  out = {
      "maxtext": installed_version(), "jax": jax.__version__,
      "libtpu": importlib.metadata.version("libtpu"), "case": case, "argv": argv[2:],
      "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
      "slice": slice_.name, "chips": slice_.chips, "devices": len(slice_.devices),
      "mesh": ",".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1),
      "params": _param_count(kept["state"]),
      # A step's tokens: MaxText's global batch (per device x devices x accumulation steps).
      "tokens": kept["config"].global_batch_size_to_train_on * kept["config"].max_target_length,
      "programs": {"train step": {
          "fits": program.fits, "peak_bytes": program.peak_bytes,
          "hbm_bytes": program.hbm_bytes, "argument_bytes": program.argument_bytes,
          "output_bytes": program.output_bytes, "alias_bytes": program.alias_bytes,
          "temp_bytes": program.temp_bytes, "code_bytes": program.code_bytes,
          "flops": program.flops, "kernel_flops": program.kernel_flops,
          "kernel_calls": program.kernel_calls, "kernel_calls_without_cost": uncounted,
          "unknown_loops": program.unknown_loops,
          "xla_flops": program.xla_flops, "bytes_accessed": program.bytes_accessed,
          # Host memory (pinned host buffers of the recipe's offloaded activations): not
          # HBM, so not in peak_bytes; jaxsys's Program has no field for it.
          **{f"host_{k}_bytes": getattr(memory, f"host_{k}_size_in_bytes", 0)
             for k in ("argument", "output", "alias", "temp")},
          "collective_bytes": program.collective_bytes, "seconds": program.seconds,
          "bound_seconds": program.bound_seconds()}},
      # Lowering and compiling the train step; and train_compile's whole run (config,
      # abstract model and optimizer state, then the compile).
      "compile_seconds": kept["wall"], "compile_cpu_seconds": kept["cpu"],
      "total_seconds": total_wall, "total_cpu_seconds": total_cpu}
  return out


def _gib(n: float) -> str:
  return f"{n / 2 ** 30:.2f} GiB"


def summary(out: dict) -> str:
  """What the binary prints of `compile_case`'s figures: memory, FLOPs, collectives, time."""
  p = out["programs"]["train step"]
  sent = ", ".join(f"{k} {_gib(v)}" for k, v in p["collective_bytes"].items()) or "none"
  return (f"MaxText {out['maxtext']} {out['case']} on {out['slice']} (mesh {out['mesh']}, "
          f"{out['params']} params, {out['tokens']} tokens), train step per device:\n"
          f"  memory {_gib(p['peak_bytes'])} of {_gib(p['hbm_bytes'])}: arguments "
          f"{_gib(p['argument_bytes'])}, outputs {_gib(p['output_bytes'])} (aliased "
          f"{_gib(p['alias_bytes'])}), temporaries {_gib(p['temp_bytes'])}, code "
          f"{_gib(p['code_bytes'])}; on the host: temporaries {_gib(p['host_temp_bytes'])}\n"
          f"  FLOPs {p['flops']:.4g} (kernels {p['kernel_flops']:.4g}; not counted: "
          f"{p['kernel_calls_without_cost']} of {p['kernel_calls']} kernel calls, which "
          f"declare no cost; {p['unknown_loops']} loops of unknown length)\n"
          f"  collectives sent: {sent}\n"
          f"  compiled in {out['compile_seconds']:.1f} s ({out['compile_cpu_seconds']:.1f} CPU "
          f"s; whole run {out['total_seconds']:.1f} s) on {os.cpu_count()} CPU cores")
