"""Strategies composed: every pair and triple compiled, larger compositions also executed.

The combinations are generated from `compositions.STRATEGIES` and `OPTIONS` (the code's own
list), not picked by hand: every pair, every variant of each strategy beside the others,
and compositions of four. Each that `config_check` accepts is compiled for 8 simulated
devices (train step, eval step, outer sync); each it refuses must say which fields clash.
A subset runs one step (and one outer sync) and must equal the same step without the
extra strategies: plain data parallelism, or the outer optimizer over replicas of data.
"""
import functools
import itertools
import pathlib

import chex
import jax
import numpy as np
import pytest

from conftest import load_test_config
from jaxsys import hlo_flops
from jaxsys import mesh as mesh_lib
from jaxsys.data import packing
from jaxsys.train import compositions
from jaxsys.train import config_check
from jaxsys.train import grads
from jaxsys.train.setup import make_setup

# A model small enough to compile quickly; eps=1 makes AdamW's first step a smooth function
# of the gradients (with eps ~ 0 it is ~ sign(g), which rounding flips where g ~ 0).
TINY = dict(model__d_model=32, model__n_layers=4, model__n_heads=4, model__n_kv_heads=2,
            model__d_ff=64, data__seq_len=32, data__batch_size=32, data__max_len=128,
            optimizer__eps=1.0,
            optimizer__warmup_steps=0, outer__sync_every=2,
            outer__fragments=2)


def _config(names, **options):
  return compositions.apply(load_test_config("stdlib", **TINY),
                            compositions.compose(names, **options))


# The partner each strategy's variants are compiled beside: the pairing hardest to get right.
VARIANT_PARTNER = {"pipeline": "context", "context": "pipeline", "outer": "pipeline",
                   "hdp": "pipeline"}


def _combinations() -> list[tuple[tuple[str, ...], dict]]:
  """Every pair; every variant of each strategy (beside its partner); compositions of four.

  `data` takes the devices the others leave in every composition, so a pair with `data`
  is its partner alone: checked by the config check (the support matrix), compiled as part
  of every other combination."""
  out = [(pair, {}) for pair in compositions.pairs() if "data" not in pair]
  for name, fields in compositions.OPTIONS.items():
    for field, values in fields.items():
      out += [((name, VARIANT_PARTNER[name]), {field.replace(".", "__"): value})
              for value in values[1:]]
  out += [(four, {}) for four in (("outer", "pipeline", "context", "accumulation"),
                                  ("pipeline", "context", "tensor", "accumulation"),
                                  ("outer", "pipeline", "fsdp", "accumulation"),
                                  ("outer", "context", "tensor", "accumulation"))]
  return out


# Executed below (which compiles them too); the others are compiled only.
EXECUTED = [
    (("pipeline", "context"), {}),
    (("pipeline", "tensor"), {"pipeline__schedule": "gpipe"}),
    (("pipeline", "accumulation"), {"pipeline__vocab_parallel": True}),
    (("context", "accumulation"), {"parallel__context_layout": "contiguous",
                                   "parallel__context_algorithm": "ulysses"}),
    (("pipeline", "context", "tensor", "accumulation"),
     {"parallel__context_algorithm": "all_gather"}),
    (("outer", "context"), {}),
    (("outer", "pipeline"), {"outer__name": "streaming_diloco"}),
    (("outer", "pipeline", "context", "accumulation"), {"pipeline__vocab_parallel": True}),
    (("outer", "context", "tensor", "accumulation"), {"outer__name": "co2"}),
    (("outer", "pipeline", "fsdp", "accumulation"), {"pipeline__schedule": "gpipe",
                                                     "pipeline__gather_once": True}),
    # XLA's partitioner aborted this one's compile (the head with fsdp and context both
    # automatic in the stage-manual region): the executor now gathers its weights once.
    (("pipeline", "context", "fsdp"), {"pipeline__vocab_parallel": True}),
]
# Compiled, not run: the backend's optimisations only cost time (the HLO, its FLOPs and
# collectives are the same; -35% compile time measured).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
_ID = lambda combo: "+".join(combo[0]) + "".join(f",{k.split('__')[-1]}={v}"
                                                 for k, v in combo[1].items())
# The fast tier compiles every pair and the interleaved pipeline; the compositions of four
# and the other variants (schedules, layouts, algorithms, outer optimizers) the whole suite.
FAST_VARIANTS = [(("pipeline", "context"), {"pipeline__schedule": "interleaved_1f1b"})]
# Every triple, and each with a pipeline again with vocabulary parallelism: an abort inside
# XLA (stage x context x fsdp with VP) hid behind pairs that all passed. The whole suite's.
TRIPLES = [(three, options) for three in itertools.combinations(
    [s for s in compositions.STRATEGIES if s != "data"], 3)
           for options in ({}, {"pipeline__vocab_parallel": True})
           if not options or "pipeline" in three]
COMBINATIONS = [pytest.param(*c, id=_ID(c), marks=[] if len(c[0]) == 2 and (
    not c[1] or c in FAST_VARIANTS) else [pytest.mark.slow])
                for c in _combinations() if c not in EXECUTED] + [
                    pytest.param(*c, id=_ID(c), marks=[pytest.mark.slow])
                    for c in TRIPLES if c not in EXECUTED]


def _batch(config):
  b = packing.random_packed_batch(config.data.batch_size, config.data.seq_len, docs_per_row=3,
                                  vocab_size=256, seed=1)
  return b


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


@functools.lru_cache(maxsize=None)
def _data_parallel_flops() -> float:
  """Matmul FLOPs per device of plain data parallelism's step on the same global batch."""
  return _compiled(_config(()))[0]


def _setup(config):
  run = config_check.check_config(config)
  return make_setup(run, mesh_lib.make_mesh(run.mesh))


def _compiled(config):
  """(matmul FLOPs per device, the compiled train step, setup, abstract state and batch)."""
  setup = _setup(config)
  state = _abstract(setup.abstract, setup.state_sh)
  batch = _abstract(_batch(config), {k: setup.batch_sh for k in _batch(config)})
  compiled = setup.train_fn.lower(state, batch).compile(FAST_COMPILE)
  return hlo_flops.dot_flops(compiled.as_text()), compiled, setup, state, batch


@pytest.mark.parametrize("names,options", COMBINATIONS)
def test_compiles_or_refuses_naming_fields(names, options):
  """Compiles (train step, eval, outer sync) or refuses in one line naming the fields; what
  compiles splits the work: per device, at most 1.1x data parallelism's matmul FLOPs
  (HLO, loops in full). Not held to it: pipelines, whose ticks are conditionals counted at
  their dearest branch (an upper bound, not what runs)."""
  config = _config(names, **options)
  why = compositions.refusal(config)
  if why is not None:  # one line naming a field or mesh axis of each strategy of a pair; a
    # larger composition's refusal may be one of its pairs', naming those two
    assert "\n" not in why
    words = lambda s: ([f for f, _ in compositions.STRATEGIES[s].fields] + list(options) +
                       [a for a, _ in compositions.STRATEGIES[s].axes])
    named = {s for s in names if any(w.replace("__", ".") in why for w in words(s))}
    assert named >= set(names) - {"data"} if len(names) == 2 else named, (names, why)
    return
  if config.parallel.hdp:  # plans each batch of documents: its update and a ring's micro-step
    setup = _setup(config)
    for lowered in setup.train_fn.lower(_abstract(setup.abstract, setup.state_sh)):
      assert lowered.compile(FAST_COMPILE).cost_analysis()["flops"] > 0
    return
  flops, _, setup, state, batch = _compiled(config)
  if setup.schedule is not None:  # the schedule's forwards: an executor of its own
    params = jax.eval_shape(setup.eval_params, state.params)
    setup.eval_fn(np.ones(256)).lower(params, batch).compile(FAST_COMPILE)
  if setup.sync_fn is not None:
    setup.sync_fn.lower(state).compile(FAST_COMPILE)
  if setup.schedule is None:
    assert flops <= 1.1 * _data_parallel_flops(), flops / _data_parallel_flops()


@functools.lru_cache(maxsize=None)
def _reference_step(names: tuple[str, ...], outer_options: tuple) -> tuple:
  """`_step` of the reference (shared by the tests that compare with it)."""
  return _step(_config(names, **dict(outer_options)))


def _step(config):
  """Loss, and the saved-form state after one step (and one outer sync)."""
  setup = _setup(config)
  state, metrics = setup.train_fn(setup.init_state(0), setup.batch_fn(_batch(config)))
  if setup.sync_fn is not None:
    state = setup.sync_fn(state)
  return (float(grads.replica_totals(jax.device_get(metrics))["loss"]),
          jax.device_get(setup.to_saved(state)))


@pytest.mark.parametrize("names,options", EXECUTED, ids=map(_ID, EXECUTED))
@pytest.mark.slow
def test_one_step_equals_the_step_without_them(names, options):
  config = _config(names, **options)
  assert compositions.refusal(config) is None
  reference = tuple((k, v) for k, v in options.items() if k.startswith("outer__name"))
  loss, state = _step(config)
  ref_loss, ref_state = _reference_step(("outer",) if "outer" in names else (), reference)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  chex.assert_trees_all_close(state.params, ref_state.params, rtol=1e-5, atol=1e-6)
  if state.outer is not None:
    chex.assert_trees_all_close(state.outer, ref_state.outer, rtol=1e-5, atol=1e-6)


def _documents(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, size=n + 1).astype(np.int32) for n in lengths]


def _one_row_each(parts, rows: int, length: int) -> dict:
  """Replica r's documents (parts[r]) one to a row in its block of `rows` rows, padded."""
  out = {k: np.zeros((len(parts) * rows, length), np.float32 if k == "loss_mask" else np.int32)
         for k in packing.FIELDS}
  for r, docs in enumerate(parts):
    for i, doc in enumerate(docs):
      n, row = len(doc) - 1, r * rows + i
      out["inputs"][row, :n], out["targets"][row, :n] = doc[:-1], doc[1:]
      out["segment_ids"][row, :n], out["positions"][row, :n] = 1, np.arange(n)
      out["loss_mask"][row, :n] = 1
  return out


HDP_CASES = [(("hdp", "outer", "tensor"), {"outer__name": "co2"}),
             (("hdp", "pipeline", "fsdp"), {"pipeline__vocab_parallel": True}),
             (("hdp", "outer", "pipeline"), {"pipeline__schedule": "gpipe"})]


@pytest.mark.parametrize("names,options", HDP_CASES, ids=map(_ID, HDP_CASES))
@pytest.mark.slow
def test_hdp_equals_data_parallelism_over_the_same_documents(names, options):
  """HDP (whole documents over rings; in each replica, one pool per replica; over pipelines,
  the micro-steps as microbatches): one step (and one outer sync) equals plain data
  parallelism (replicas of it) over the same documents, one to a row, each replica's where
  the planner sent them."""
  config = _config(names, data__max_len=64, **options)
  setup = _setup(config)
  # Rings and local slots in one step, a few cell sizes: each over-pipeline program costs
  # seconds to trace and compile (15 documents of 15 lengths took twice as long, same paths).
  lengths = [60, 61, 30, 31, 29, 28, 3, 2]
  batch = setup.batch_fn({"tokens": _documents(lengths)})
  parts = [part["tokens"] for part in batch.get("replicas", [batch])]
  assert all(parts) and sum(map(len, parts)) == len(lengths)  # every document, every pool
  state, metrics = setup.train_fn(setup.init_state(0), batch)
  assert np.max(metrics["micro_steps"]) > 1  # per replica [R] with replicas
  inner = jax.device_get(setup.to_saved(state))  # each replica's own step, before the sync

  reference = _setup(compositions.apply(config, {
      "parallel.hdp": False, "data.variable_length": False, "pipeline.schedule": "none",
      "pipeline.vocab_parallel": False, "mesh": "replica=2,data=4" if setup.view.replicas else "data=8"}))
  rows = 8 // len(parts) * -(-max(map(len, parts)) // (8 // len(parts)))
  ref_batch = jax.device_put(_one_row_each(parts, rows, max(lengths)), reference.batch_sh)
  ref_state, ref_metrics = reference.train_fn(reference.init_state(0), ref_batch)
  ref_inner = jax.device_get(reference.to_saved(ref_state))
  # Both per replica with replicas ([R]): the run's totals combine them alike.
  metrics = grads.replica_totals(jax.device_get(metrics))
  assert float(metrics["tokens"]) == sum(lengths)
  ref_loss = grads.replica_totals(jax.device_get(ref_metrics))["loss"]
  np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=1e-5)
  chex.assert_trees_all_close((inner.params, inner.opt_state),
                              (ref_inner.params, ref_inner.opt_state), rtol=1e-5, atol=2e-5)
  if setup.sync_fn is not None:
    state = jax.device_get(setup.to_saved(setup.sync_fn(state)))
    ref_state = jax.device_get(reference.to_saved(reference.sync_fn(ref_state)))
    chex.assert_trees_all_close(state.params, ref_state.params, rtol=1e-5, atol=2e-5)
    chex.assert_trees_all_close(state.outer, ref_state.outer, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("document", ["README.md", "docs/design.md"])
def test_support_matrix_in_the_docs_is_the_code_s(document):
  """The support matrix shown is `compositions.matrix_markdown` of the code's refusals."""
  matrix = compositions.matrix_markdown(compositions.support_matrix(_config(())))
  text = (pathlib.Path(__file__).parents[2] / document).read_text()
  assert matrix in text, f"{document}'s support matrix is stale; paste:\n" + matrix

