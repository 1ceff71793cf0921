"""Test setup: 8 simulated CPU devices, set before jax initialises its backends."""
import os
import tempfile

# The tests' programs are tiny: compiling them costs more than running them, so XLA:CPU
# skips LLVM's optimisations and emits fusions with its older, quicker emitters (HLO passes,
# shardings, cost analysis and memory stay the same). On the 2-core VM the first cut
# compile-bound tests by about 35%, the second compile times by a further ~30%.
_FLAGS = os.environ.get("XLA_FLAGS", "")
_CHEAP_COMPILES = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false"}
os.environ["XLA_FLAGS"] = (_FLAGS + " --xla_force_host_platform_device_count=8" + "".join(
    f" --{flag}={value}" for flag, value in _CHEAP_COMPILES.items() if flag not in _FLAGS)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One compilation cache for the whole run, shared by every xdist worker and every run they
# start as a process: the trainer's tiny programs compile once, not once per subprocess.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"jaxsys-tests-{os.environ.get('PYTEST_XDIST_TESTRUNUID', os.getpid())}"))
# Every program, however quick to compile (jax's default caches only those over 1 s): the
# runs' programs compile in well under a second with the flags above, and each restart
# of a run would compile them again (-7% CPU on the CLI and fault tests).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import contextlib
import functools
import importlib.util
import pathlib
import shutil
import sysconfig

import pytest

# Left out of the fast tier (`pytest -m "not slow"`), run by the whole suite: tests that
# start processes or notebooks, train end to end, or were the fast tier's longest (4-15 s
# and more on a 2-core VM) while it ran over its 4 minutes.
SLOW = (
    "tests/experiments/",
    "tests/colab/",
    "tests/checkpoint/test_snapshots.py::test_sigkill",
    "tests/checkpoint/test_layouts.py::test_one_model_to_diloco_replicas_and_back",
    "tests/checkpoint/test_layouts.py::test_resume_under_another_layout_is_exact",
    "tests/checkpoint/test_layouts.py::test_every_checkpoint_describes_its_layout",
    "tests/kernels/test_attention_pallas.py::PallasAttentionTest::test_hypothesis_shapes",
    "tests/kernels/test_attention_xla.py::XlaAttentionTest::test_random_shapes",
    "tests/models/test_transformer.py::TransformerTest::test_bf16_compute_f32_params",
    "tests/models/test_transformer.py::TransformerTest::test_remat_matches_and_saves_less",
    "tests/optim/test_streaming.py::test_matches_the_step_by_step_reference",
    "tests/parallel/test_pipeline.py::test_1f1b_memory_grows_with_stages_not_microbatches",
    "tests/parallel/test_pipeline.py::test_remat_and_bf16_compute",
    "tests/parallel/test_pipeline.py::test_interleaved_with_two_virtual_stages_on_four",
    "tests/parallel/test_pipeline.py::test_gather_once_moves_weights_once_a_step",
    "tests/parallel/test_routing.py::test_four_replicas_with_odd_shifts_follow_the_route",
    "tests/parallel/test_routing.py::test_identity_routing",
    "tests/parallel/test_routing.py::test_random_routing_gradients_follow_the_route",
    "tests/quant/test_quant_eval.py::test_quant_eval_end_to_end",
    "tests/parallel/test_pipeline.py::test_matches_unpipelined[stage=2,data=4-gpipe-4-1-False]",
    "tests/parallel/test_routing.py::test_random_routing_attributes_losses_to_their_rows",
    "tests/train/test_aot.py::test_composed_run_compiles_for_an_8_chip_slice",
    "tests/train/test_aot.py::test_compiled_flops_are_the_model_s",
    "tests/train/test_aot.py::test_a_step_that_does_not_fit_is_reported",
    "tests/train/test_aot.py::test_the_tpu_kernels_are_chosen_for_the_slice",
    "tests/train/test_compositions.py::test_one_step_equals_the_step_without_them",
    "tests/train/test_compositions.py::test_hdp_equals_data_parallelism_over_the_same_documents",
    "tests/train/test_hdp_step.py::HDPStepTest::test_hdp_step_equals_single_device_step",
    "tests/train/test_init_from.py",
    "tests/train/test_loop.py::test_resume_is_exact",
    "tests/train/test_loop.py::test_nan_stops_without_saving",
    "tests/train/test_loop.py::test_resume_with_other_numerics_refused_unless_allowed",
    "tests/train/test_loop.py::test_profile_holds_the_annotated_steps",
    "tests/train/test_pipelined.py::test_resume_under_another_schedule",
    "tests/train/test_pipelined.py::test_outer_optimizer_over_pipelined_replicas",
    "tests/train/test_replicas.py::test_streaming_diloco_resumes_exactly_mid_overlap",
    "tests/train/test_replicas.py::test_resume_is_exact_with_outer_state",
    "tests/train/test_comm_device.py::test_resume_is_exact_with_an_average_in_flight",
    "tests/train/test_step.py::TrainStepTest::test_context_parallel_equals_data_parallel",
    "tests/train/test_step.py::TrainStepTest::test_sharded_equals_single_device",
    "tests/train/test_aot.py::test_the_gpu_kernels_are_chosen_for_the_gpus",
    "tests/parallel/test_zero_bubble.py::test_training_run_with_zbv",
    "tests/parallel/test_zero_bubble.py::test_split_backward_does_the_work_once",
    "tests/parallel/test_zero_bubble.py::test_context_axis",
    "tests/parallel/test_zero_bubble.py::test_matches_unpipelined[stage=4,data=2-zb_h1-8-1-4-False-True]",
    "tests/parallel/test_zero_bubble.py::test_matches_unpipelined[stage=2,tensor=2,data=2-zb_h1-4-1-4-True-True]",
    "tests/parallel/test_zero_bubble.py::test_matches_unpipelined[stage=4,tensor=2-zbv-8-2-8-False-True]",
    "tests/parallel/test_zero_bubble.py::test_matches_unpipelined[stage=2,data=4-zbv-4-2-4-True-False]",
    "tests/parallel/test_zero_bubble.py::test_matches_unpipelined[stage=2,data=4-zbv-4-2-4-True-True]",
    "tests/train/test_hdp_step.py::HDPStepTest::test_tensor_splits_and_fsdp_shards_in_the_compiled_programs",
    "tests/train/test_loop.py::test_trains_evaluates_and_checkpoints",
    "tests/train/test_loop.py::test_refuses_checkpoint_of_another_model",
    "tests/train/test_pipelined.py::test_views_round_trip",
    "tests/parallel/test_pipeline.py::test_matches_unpipelined[stage=4,tensor=2-interleaved_1f1b-8-1-False]",
    "tests/parallel/test_pipeline.py::test_matches_unpipelined[stage=4,data=2-1f1b-4-1-False]",
    "tests/parallel/test_pipeline.py::test_matches_unpipelined[stage=2,data=4-gpipe-4-1-True]",
    "tests/parallel/test_pipeline.py::test_matches_unpipelined[stage=2,data=4-interleaved_1f1b-4-2-True]",
    # The tick shapes' own tests (3-6 s each; the default shapes run in the fast tier's
    # exactness tests above).
    "tests/parallel/test_pipeline.py::test_both_tick_shapes_exact",
    "tests/parallel/test_pipeline.py::test_executed_ticks_match_the_schedule",
    "tests/parallel/test_zero_bubble.py::test_executed_ticks_match_the_schedule",
    "tests/parallel/test_pipeline.py::test_matches_unpipelined[stage=2,data=4-eager_1f1b-4-1-True]",
    "tests/parallel/test_pipeline.py::test_matches_unpipelined[stage=2,tensor=2,data=2-1f1b-4-1-False]",
    # The fast tier's longest at 5 min 17 s (3.9-7 s each): a second case of a schedule or
    # VP algorithm the tier checks once, runs that train end to end, compiled-bytes checks.
    "tests/parallel/test_pipeline.py::test_matches_unpipelined[stage=4,data=2-gpipe-8-1-True]",
    "tests/parallel/test_pipeline.py::test_matches_unpipelined[stage=2,tensor=2,data=2-1f1b-4-1-True]",
    "tests/parallel/test_pipeline.py::test_matches_unpipelined[stage=4,tensor=2-interleaved_1f1b-8-1-True]",
    "tests/parallel/test_pipeline.py::test_embeddings_and_vocab_algorithms[stage=4,data=2-True-False-2]",
    "tests/parallel/test_pipeline.py::test_embeddings_and_vocab_algorithms[stage=2,tensor=2,data=2-False-True-1]",
    "tests/parallel/test_pipeline.py::test_embeddings_and_vocab_algorithms[stage=2,tensor=2,data=2-True-True-2]",
    "tests/parallel/test_routing.py::test_bytes_match_the_compiled_program",
    "tests/parallel/test_routing.py::test_four_replicas_zero_bubble_follow_the_route",
    "tests/checkpoint/test_hf.py::test_run_starts_from_hf_and_exports",
    "tests/checkpoint/test_hf.py::test_run_export_loads_in_transformers",
    "tests/models/test_generate.py::GenerateTest::test_sharded_equals_unsharded1",
    "tests/train/test_replicas.py::test_data_parallel_logs_gradient_bytes",
    # Then 4 min 28 s: more second cases (the fast tier keeps each chip's smaller flash
    # compiles, one tick-copy case, the sharded static HDP-bytes step, the other TPU kernels).
    "tests/kernels/test_tpu_compile.py::test_flash_attention_compiles[128-",
    "tests/kernels/test_attention_pallas_tpu.py::PallasTpuAttentionTest::test_default_blocks_odd_head_dim_shuffled_parallel_axes",
    "tests/kernels/test_attention_pallas_tpu.py::PallasTpuAttentionTest::test_packed_segments_gqa2_noncausal_batch2",
    "tests/kernels/test_quant_matmul.py::PackingTest::test_round_trip",
    "tests/parallel/test_context.py::test_explicit_positions_equal_derived",
    "tests/parallel/test_pipeline.py::test_a_tick_copies_no_buffer[1f1b-",
    "tests/train/test_hdp_sim_bytes.py::test_static_step",
    "tests/parallel/test_vocab_schedule.py::test_statistics_all_reduce_is_carried_to_the_next_tick[1]",
    "tests/parallel/test_vocab_schedule.py::test_overlap_matches_unpipelined[stage=2,data=4-1]",
    "tests/parallel/test_vocab_schedule.py::test_overlap_matches_unpipelined[stage=2,tensor=2,data=2-1]",
    "tests/parallel/test_vocab_schedule.py::test_overlapped_all_reduces_are_carried[1]",
)


# The longest tests, longest first (2-core VM, docs/results/testing.md): 35-90 s each.
LONGEST = (
    "tests/experiments/test_multiprocess.py::test_composed_run_killed_resumes_merged",
    "tests/experiments/test_faults.py::test_sigkill_at_random_points",
    "tests/experiments/test_multiprocess.py::test_two_processes_match_one",
    "tests/experiments/test_faults.py::test_damaged_checkpoints",
    "tests/train/test_loop.py::test_resume_is_exact[hdp_in_diloco_replicas]",
    "tests/experiments/test_bench_hdp.py::test_real_part",
)


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: left out of the fast tier (pytest -m 'not slow')")


def pytest_collection_modifyitems(items):
  for item in items:
    if item.nodeid.startswith(SLOW):
      item.add_marker(pytest.mark.slow)
  # Longest first (the measured longest, then the other slow tests): a worker that runs out
  # steals from the end of another's queue, so what is left at the end is short, and no
  # long test runs alone while the other workers wait.
  items.sort(key=lambda item: (next((i for i, t in enumerate(LONGEST) if item.nodeid.startswith(t)),
                                    len(LONGEST)), item.get_closest_marker("slow") is None))


def pytest_sessionfinish(session):
  if _OWN_CACHE and not hasattr(session.config, "workerinput"):  # the controller, at the end
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# TPU executables built on this CPU host need libtpu, which the README's test command
# installs (the `tpu` extra): CI must run those tests, a plain `.[dev]` install skips them.
needs_libtpu = pytest.mark.skipif(
    not os.environ.get("CI") and importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed: pip install -e '.[dev,tpu]'")
# GPU executables built here need jax's CUDA plugin (no CUDA libraries, no GPU), which the
# README's test command installs (the `gpu-compile` extra).
needs_cuda_plugin = pytest.mark.skipif(
    not os.environ.get("CI") and importlib.util.find_spec("jax_plugins") is None,
    reason="jax's CUDA plugin is not installed: pip install -e '.[dev,gpu-compile]'")


def flash_value_and_grads(attention, *, causal: bool, packed: bool):
  """(q, k, v, ids) -> the summed output and its q/k/v gradients through a Pallas flash
  kernel compiled for real (`attention(q, k, v, causal=, interpret=False, ...)`): forward and
  both backward kernels, for the tests that compile kernels for TPU and GPU chips."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  def value_and_grads(q, k, v, ids):
    def loss(q, k, v):
      segments = dict(q_segment_ids=ids, kv_segment_ids=ids) if packed else {}
      out = attention(q, k, v, causal=causal, interpret=False, **segments)
      return jnp.sum(out.astype(jnp.float32))
    return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)
  return value_and_grads


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> str:
  """A directory of ~200 real stdlib source files (a few hundred KB): fast loaders in tests.

  File names keep their stdlib-relative paths, so the hash split is fixed and has val files.
  """
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  out = tmp_path_factory.mktemp("corpus")
  files = sorted(p for p in (root / "email").rglob("*.py")) + sorted(root.glob("*.py"))
  for path in files:
    text = path.read_bytes()[:4000]
    dest = out / path.relative_to(root)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(text)
  return str(out)


@pytest.fixture
def make_config(small_corpus):
  """Factory: configs/tiny_lm.py:size=test on the small corpus, with dotted-name overrides."""
  return functools.partial(load_test_config, small_corpus)


def load_test_config(source: str, **overrides):
  """configs/tiny_lm.py:size=test on `source`; overrides use '.'-free names like model__d_model."""
  spec = importlib.util.spec_from_file_location(
      "tiny_lm", pathlib.Path(__file__).parent.parent / "configs" / "tiny_lm.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("size=test")
  config.data.source = source
  config.data.num_threads = 0
  from jaxsys.train.compositions import set_fields  # after XLA_FLAGS is set above
  return set_fields(config, overrides, sep="__")


def load_run_config(source: str = "stdlib", **overrides):
  """`load_test_config`, checked: the typed `jaxsys.config.RunConfig` library code takes."""
  from jaxsys.train.config_check import check_config
  return check_config(load_test_config(source, **overrides))


# ---------------------------------------------------------------- binaries' absl flags

_OWNERS = ("experiments.", "jaxsys.")  # whose flags a test may set aside


def _owned_flags() -> dict[str, tuple[str, object]]:
  """{name: (module, flag)} of every flag experiments' and jaxsys's modules defined."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  return {f.name: (module, f) for module, fs in flags.FLAGS.flags_by_module_dict().items()
          if module.startswith(_OWNERS) for f in fs}


@contextlib.contextmanager
def _only_flags(wanted: dict[str, tuple[str, object]]):
  """Inside the block, of experiments' and jaxsys's flags only `wanted` are defined; the
  others are set aside and come back after."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  saved = _owned_flags()
  for name in saved:
    delattr(flags.FLAGS, name)
  for name, (module, flag) in wanted.items():
    flags.FLAGS[name] = flag
    flags.FLAGS.register_flag_by_module(module, flag)
  try:
    yield
  finally:
    for name in _owned_flags():
      delattr(flags.FLAGS, name)
    for name, (module, flag) in saved.items():
      flags.FLAGS[name] = flag
      flags.FLAGS.register_flag_by_module(module, flag)


def import_binary(name: str):
  """experiments.<name>, imported with the absl flags it defines set aside again: flags are
  process-global and binaries share names (--out, --config, --steps), so two imported in
  one test worker would clash. Its functions take arguments; a test that parses its flags
  does so inside `binary_flags(module)`."""
  with _only_flags({}):
    module = importlib.import_module(f"experiments.{name}")
    module.defined_flags = _owned_flags()
  return module


def binary_flags(module):
  """A block in which `module`'s flags (import_binary's) are the defined ones."""
  return _only_flags(module.defined_flags)
