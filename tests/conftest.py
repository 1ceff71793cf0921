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

# The longest tests, longest first (2-core VM, docs/results/testing.md): 35-90 s each.
LONGEST = (
    "tests/experiments/test_multiprocess.py::test_composed_run_killed_resumes_merged",
    "tests/experiments/test_faults.py::test_sigkill_at_random_points",
    "tests/experiments/test_multiprocess.py::test_two_processes_match_one",
    "tests/experiments/test_faults.py::test_damaged_checkpoints",
    "tests/train/test_loop.py::test_resume_is_exact[hdp_in_diloco_replicas]",
    "tests/experiments/test_bench_hdp.py::test_real_part",
)


def pytest_collection_modifyitems(items):
  # Longest first (the measured longest, then the other slow tests): a worker that runs out
  # steals from the end of another's queue, so what is left at the end is short, and no
  # long test runs alone while the other workers wait.
  items.sort(key=lambda item: (next((i for i, t in enumerate(LONGEST) if item.nodeid.startswith(t)),
                                    len(LONGEST)), item.get_closest_marker("slow") is None))


# JAXSYS_TEST_CPU=<file>: each test's CPU seconds (its worker's threads and the processes it
# waited for) appended to <file> as "seconds nodeid" lines. Unlike --durations' wall time, a
# loaded machine hardly changes it, so it says where the suite's time goes on any machine.
_CPU_LOG = os.environ.get("JAXSYS_TEST_CPU")


def _cpu_seconds() -> float:
  import resource  # pylint: disable=import-outside-toplevel
  return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                resource.getrusage(resource.RUSAGE_CHILDREN)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # pylint: disable=unused-argument
  start = _cpu_seconds() if _CPU_LOG else None
  yield
  if start is not None:
    with open(_CPU_LOG, "a", encoding="utf-8") as log:
      log.write(f"{_cpu_seconds() - start:.2f} {item.nodeid}\n")


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


def windowed_flash_hlo(attention, sharding) -> str:
  """The compiled HLO of `attention`'s flash kernels (forward and both backward) with
  Mistral 7B v0.1's window of 4096 over 8192 packed tokens, inputs on `sharding`: for the
  tests that compile the windowed kernels for real TPU and GPU chips."""
  import functools  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  q, kv = spec((1, 8192, 8, 128), jnp.bfloat16), spec((1, 8192, 2, 128), jnp.bfloat16)
  value_and_grads = flash_value_and_grads(functools.partial(attention, window=4096),
                                          causal=True, packed=True)
  return jax.jit(value_and_grads).lower(q, kv, kv, spec((1, 8192), jnp.int32)).compile().as_text()


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
