"""The memory estimate (jaxsys/train/memory_estimate.py): each term scales with the fields
that size it, a run that cannot fit is refused in one line before any work (the override
runs it anyway), and the estimate is within 1.5x of XLA:CPU's compiled train step for the
presets."""
import pathlib
import subprocess
import sys
import time

import chex
import jax
import pytest
from absl.testing import absltest, parameterized

from conftest import load_test_config
from jaxsys import mesh as mesh_lib
from jaxsys.configs import llama3, tiny_lm
from jaxsys.train import aot, config_check, loop
from jaxsys.train import memory_estimate as me
from jaxsys.train.setup import make_setup

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _estimate(config_or_overrides) -> me.Estimate:
  config = (config_or_overrides if hasattr(config_or_overrides, "to_dict")
            else load_test_config("stdlib", **config_or_overrides))
  run = config_check.parse(config)
  return me.estimate(run, mesh_lib.make_mesh(run.mesh))


class TermsTest(parameterized.TestCase):
  """Each term follows its fields: a term dropped or mis-scaled fails one of these."""

  def test_every_term_is_counted(self):
    est = _estimate(dict(mesh="fsdp=8"))
    self.assertEqual(list(est.device), ["parameters", "Adam moments", "gradients",
                                        "weights gathered for compute", "activations",
                                        "logits", "batch"])
    self.assertEqual(list(est.host), ["loader buffers"])
    self.assertTrue(all(v > 0 for v in {**est.device, **est.host}.values()))
    chex.assert_trees_all_close(est.device_bytes, sum(est.device.values()))

  def test_state_is_exact(self):
    """Parameters at their dtype, Adam's two moments float32 each, the gradients again."""
    run = config_check.parse(load_test_config("stdlib"))
    est = me.estimate(run, mesh_lib.make_mesh("data=8"))
    params = 4 * sum(x.size for x in jax.tree.leaves(
        make_setup(run, mesh_lib.make_mesh("data=8")).abstract.params))
    self.assertEqual(est.device["parameters"], params)
    self.assertEqual(est.device["gradients"], params)
    self.assertAlmostEqual(est.device["Adam moments"], 2 * params, delta=64)  # + step counts

  def test_batch_doubles_activations_logits_and_buffers(self):
    one, two = _estimate(dict(data__batch_size=16)), _estimate(dict(data__batch_size=32))
    for term in ("activations", "logits", "batch"):
      self.assertEqual(two.device[term], 2 * one.device[term], term)
    self.assertEqual(two.host["loader buffers"], 2 * one.host["loader buffers"])
    for term in ("parameters", "Adam moments", "gradients"):
      self.assertEqual(two.device[term], one.device[term], term)

  def test_seq_len_doubles_activations(self):
    one, two = _estimate(dict(data__seq_len=64)), _estimate(dict(data__seq_len=128,
                                                                  data__max_len=512))
    self.assertEqual(two.device["activations"], 2 * one.device["activations"])

  def test_fsdp_divides_the_state_by_8_and_gathers_weights(self):
    data, fsdp = _estimate(dict(mesh="data=8")), _estimate(dict(mesh="fsdp=8"))
    for term in ("parameters", "Adam moments", "gradients"):
      self.assertAlmostEqual(fsdp.device[term], data.device[term] / 8,
                             delta=0.01 * data.device[term], msg=term)
    self.assertNotIn("weights gathered for compute", data.device)
    self.assertEqual(fsdp.device["activations"], data.device["activations"])

  def test_accumulation_halves_activations_and_keeps_a_running_sum(self):
    one, two = (_estimate(dict(optimizer__grad_accum_steps=1)),
                _estimate(dict(optimizer__grad_accum_steps=2)))
    self.assertEqual(two.device["activations"], one.device["activations"] / 2)
    self.assertEqual(two.device["logits"], one.device["logits"] / 2)
    self.assertEqual(two.device["gradients"], 2 * one.device["gradients"])

  def test_remat_keeps_less_in_a_scanned_stack_only_on_cpu(self):
    """Scanned (> UNROLL_MAX_LAYERS layers): full keeps a layer's input; unrolled, XLA:CPU
    keeps everything whatever the policy (measured: tiny 66.1 vs 70.9 MB)."""
    deep = dict(model__n_layers=10)
    none, full = _estimate(dict(deep, model__remat="none")), _estimate(
        dict(deep, model__remat="full"))
    self.assertLess(full.device["activations"], none.device["activations"] / 3)
    self.assertEqual(_estimate(dict(model__remat="full")).device["activations"],
                     _estimate(dict(model__remat="none")).device["activations"])

  def test_tensor_splits_heads_and_mlp(self):
    one = _estimate(dict(mesh="data=8", data__batch_size=16))
    two = _estimate(dict(mesh="data=4,tensor=2", data__batch_size=8))  # same rows a device
    self.assertLess(two.device["activations"], one.device["activations"])
    self.assertGreater(two.device["activations"], one.device["activations"] / 2)  # D whole
    self.assertEqual(two.device["logits"], one.device["logits"] / 2)

  def test_context_splits_the_sequence(self):
    one = _estimate(dict(mesh="data=8", data__batch_size=16))
    two = _estimate(dict(mesh="data=4,context=2", data__batch_size=8))
    self.assertEqual(two.device["activations"], one.device["activations"] / 2)

  def test_pipeline_holds_its_stage_layers_and_in_flight_microbatches(self):
    base = dict(mesh="data=4,stage=2", model__n_layers=4, pipeline__microbatches=4)
    flat = _estimate(dict(mesh="data=4,stage=2", model__n_layers=4))  # 4 layers, 4 rows
    gpipe = _estimate(dict(base, pipeline__schedule="gpipe"))
    one_f1b = _estimate(dict(base, pipeline__schedule="1f1b"))
    self.assertAlmostEqual(gpipe.device["parameters"] / flat.device["parameters"], 0.5,
                           delta=0.2)  # the layers split, the embedding whole
    # A stage: 2 of the 4 layers; GPipe keeps all 4 microbatches (of 1 row), 1F1B 2.
    microbatch_chunk = flat.device["activations"] / 2 / 4
    carry, chunks = me.PIPELINE_CARRY
    self.assertEqual(gpipe.device["activations"], (carry * 4 + chunks) * microbatch_chunk)
    self.assertEqual(one_f1b.device["activations"], (carry * 2 + chunks) * microbatch_chunk)
    self.assertEqual(gpipe.device["logits"], flat.device["logits"] / 4)  # one microbatch

  def test_bfloat16_takes_float32_room_on_cpu(self):
    self.assertEqual(_estimate(dict(model__dtype="bfloat16")).device["activations"],
                     _estimate(dict(model__dtype="float32")).device["activations"])

  def test_outer_optimizer_state_is_counted(self):
    est = _estimate(dict(mesh="replica=2,data=4", outer__name="diloco"))
    self.assertGreater(est.device["diloco state"], 0)


class RefusalTest(parameterized.TestCase):

  def test_cpu_refusal_names_the_fields_the_estimate_and_the_limit(self):
    run = config_check.parse(load_test_config("stdlib"))
    est = me.estimate(run, mesh_lib.make_mesh(run.mesh))
    line = me.refusal(run, est, me.Limit(None, 1e6, "MemAvailable"))
    self.assertStartsWith(line, "data.batch_size=16, data.seq_len=64, model.d_model=64")
    for words in ("of this host's memory: 8 CPU devices x", "activations", "loader buffers",
                  "this host has 1 MB (MemAvailable)", "--config.check_memory=false"):
      self.assertIn(words, line)
    self.assertNotIn("\n", line)
    self.assertIsNone(me.refusal(run, est, me.Limit(None, 1e12, "MemAvailable")))

  def test_device_refusal_on_an_accelerator(self):
    run = config_check.parse(load_test_config("stdlib"))
    est = me.estimate(run, mesh_lib.make_mesh(run.mesh))
    line = me.refusal(run, est, me.Limit(1e6, 1e12, "H100's bytes_limit"))
    self.assertIn("of device memory a device", line)
    self.assertIn("this device has 1 MB (H100's bytes_limit)", line)
    self.assertIsNone(me.refusal(run, est, me.Limit(1e12, 1e12, "")))

  @parameterized.parameters(("model__d_model", 10**9, "model.d_model=1000000000"),
                            ("data__batch_size", 10**12, "data.batch_size=1000000000000"))
  def test_check_config_refuses_and_the_override_passes(self, field, value, named):
    config = load_test_config("stdlib", **{field: value})
    with self.assertRaisesRegex(ValueError, f"^{named}.*check_memory=false"):
      config_check.check_config(config)
    config.check_memory = False
    self.assertFalse(config_check.check_config(config).check_memory)

  def test_the_cpu_limit_is_the_hosts_available_memory(self):
    lim = me.limit(mesh_lib.make_mesh("data=8"))
    self.assertIsNone(lim.device)  # the simulated devices are the host's memory
    with open("/proc/meminfo", encoding="ascii") as f:
      total = next(float(l.split()[1]) * 1024 for l in f if l.startswith("MemTotal:"))
    self.assertBetween(lim.host, 1e6, total)

  def test_a_saved_config_without_the_field_is_checked(self):
    values = load_test_config("stdlib").to_dict()
    del values["check_memory"]
    self.assertTrue(config_check.parse(values).check_memory)


def test_the_override_lets_a_refused_run_train(small_corpus, tmp_path, monkeypatch):
  """On a host with 1 MB to spare the test config is refused; check_memory=False trains it."""
  config = load_test_config(small_corpus, total_steps=2, eval_every=0)
  monkeypatch.setattr(me, "available_host_bytes", lambda: 1e6)
  with pytest.raises(ValueError, match="this host has 1 MB"):
    config_check.check_config(config)
  config.check_memory = False
  result = loop.train(config_check.check_config(config), str(tmp_path))
  assert result["step"] == 2


@pytest.mark.parametrize("override", ["--config.model.d_model=1000000000",
                                      "--config.data.batch_size=1000000000000"])
def test_the_binary_refuses_in_one_line_before_any_work(override, tmp_path):
  start = time.monotonic()
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.train", "--config=configs/tiny_lm.py:size=test",
       "--config.mesh=data=8", "--config.total_steps=2", f"--workdir={tmp_path}", override],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  seconds = time.monotonic() - start
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert [l for l in lines if l.startswith("error:")] == lines[-1:], proc.stderr[-3000:]
  assert override[len("--config."):] in lines[-1] and "check_memory=false" in lines[-1]
  assert "Traceback" not in proc.stderr
  assert seconds < 15, seconds  # 3.5 s on a loaded 2-core VM: nothing allocated
  assert list(tmp_path.iterdir()) == []


# The presets as shipped (each on 8 CPU devices: tiny_lm data=8, llama3 fsdp=8, remat none);
# two with remat=full (a scanned stack: the policy counts), a pipeline and replicas.
PRESETS = {"tiny": (tiny_lm, "tiny", {}), "small": (tiny_lm, "small", {}),
           "gpt2": (llama3, "gpt2", {}), "llama3-1b": (llama3, "1b", {}),
           "gpt2 remat=full": (llama3, "gpt2", {"model.remat": "full"}),
           "llama3-1b remat=full": (llama3, "1b", {"model.remat": "full"}),
           "tiny 1f1b": (tiny_lm, "tiny", {"mesh": "data=4,stage=2", "pipeline.schedule": "1f1b",
                                           "pipeline.microbatches": 4}),
           "tiny diloco": (tiny_lm, "tiny", {"mesh": "replica=2,data=4",
                                             "outer.name": "diloco"})}


def compiled_bytes(run) -> int:
  """Arguments + outputs - aliased + temporaries of the compiled train step, one device."""
  setup = make_setup(run, mesh_lib.make_mesh(run.mesh))
  state = aot._abstract(setup.abstract, setup.state_sh)  # pylint: disable=protected-access
  m = setup.train_fn.lower(state, aot._batch(run, setup.batch_sh)).compile().memory_analysis()  # pylint: disable=protected-access
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)


@pytest.mark.slow  # compiles of 9-20 s each
@pytest.mark.parametrize("name", list(PRESETS))
def test_estimate_within_1_5x_of_the_compiled_step(name):
  module, size, overrides = PRESETS[name]
  config = module.get_config(size)
  for path, value in overrides.items():
    *groups, field = path.split(".")
    node = config
    for group in groups:
      node = node[group]
    node[field] = value
  run = config_check.parse(config)
  est = me.estimate(run, mesh_lib.make_mesh(run.mesh)).device_bytes
  compiled = compiled_bytes(run)
  print(f"{name}: estimate {me.human(est)}, compiled {me.human(compiled)}, "
        f"ratio {est / compiled:.2f}")
  assert 1 / 1.5 <= est / compiled <= 1.5, (est, compiled)


if __name__ == "__main__":
  absltest.main()
