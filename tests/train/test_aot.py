"""Runs compiled for TPU slices on this CPU host (libtpu's topologies, no TPU attached)."""
import math
import os
import re
import subprocess
import sys

import jax
import pytest

from conftest import load_test_config, needs_cuda_plugin, needs_libtpu
from jaxsys import comm_bytes
from jaxsys import chips, hlo_flops
from jaxsys import mesh as mesh_lib
from jaxsys.models import transformer
from jaxsys.train import aot, config_check
from jaxsys.train.setup import make_setup


@pytest.mark.parametrize("name,chip,shape", [("v5p-128", "v5p", "4x4x4"), ("v5e-8", "v5e", "2x4"),
                                             ("v4-8", "v4", "2x2x1"), ("v6e:4x4", "v6e", "4x4"),
                                             ("V5P:2x2x2", "v5p", "2x2x2"),
                                             ("h100-8", "h100", "1x1x8"),
                                             ("h100-32", "h100", "1x4x8")])
def test_slice_names(name, chip, shape):
  assert chips.parse(name) == (chips.CHIPS[chip], shape)


@pytest.mark.parametrize("name,message", [
    ("v7x-8", "topology='v7x-8' is not a TPU slice; it must be <chip>-<n> or <chip>:<shape>"),
    ("v5p-12", "topology='v5p-12' is not a v5p slice Cloud TPU offers; valid: v5p-8, v5p-16"),
    ("v5e:2x2x2", "topology='v5e:2x2x2': a v5e shape has 2 dimensions"),
    ("h100-12", "topology='h100-12' is not a h100 GPU count jaxsys knows; valid: h100-1")])
def test_bad_slice_names(name, message):
  with pytest.raises(ValueError) as error:
    chips.parse(name)
  assert str(error.value).startswith(message) and "\n" not in str(error.value)


def _compile(topology: str, **overrides):
  slice_ = chips.slice_devices(topology)
  run = config_check.check_config(load_test_config("stdlib", **overrides), devices=slice_.devices)
  setup, programs = aot.compile_run(run, slice_)
  return run, setup, programs


# A small bf16 model with full remat and XLA attention: the compiled-step tests' default.
_SMALL = dict(model__remat="full", model__n_layers=2, model__d_model=256, model__n_heads=4,
              model__n_kv_heads=2, model__d_ff=768, model__attention_impl="xla",
              model__dtype="bfloat16", data__seq_len=256)


def _lowered_step(topology: str, **overrides):
  """(run, setup, the lowered train step) of `_SMALL` with `overrides` on the slice."""
  slice_ = chips.slice_devices(topology)
  run = config_check.check_config(load_test_config("stdlib", **(_SMALL | overrides)),
                                  devices=slice_.devices)
  setup = make_setup(run, mesh_lib.make_mesh(run.mesh, slice_.devices))
  return run, setup, setup.train_fn.lower(aot._abstract(setup.abstract, setup.state_sh),
                                          aot._batch(run, setup.batch_sh))


@needs_libtpu
def test_a_loaded_slice_leaves_no_tpu_worker_in_the_environment(monkeypatch):
  """A process started after a TPU compile (the trainer, from a notebook or a test) must not
  inherit TPU_WORKER_HOSTNAMES, or it joins a multi-host TPU run that does not exist."""
  for key, _ in chips._TPU_HOST:  # pylint: disable=protected-access
    monkeypatch.delenv(key, raising=False)
  assert len(chips.slice_devices("v5e:2x2").devices) == 4
  assert not any(key in os.environ for key, _ in chips._TPU_HOST)  # pylint: disable=protected-access


@needs_libtpu
@pytest.mark.slow
def test_the_tpu_kernels_are_chosen_for_the_slice():
  """On a v5e slice the step's attention is the Mosaic kernel (a TPU custom call), though
  jax's own backend here is the CPU; the report's memory and FLOPs are the chip's."""
  run, setup, programs = _compile("v5e:2x2", mesh="fsdp=2,tensor=2", model__d_model=128,
                                  model__n_heads=4, model__n_kv_heads=2)
  assert jax.default_backend() == "cpu"
  train = programs[0]
  assert train.kernel_flops > 0  # read from the HLO's tpu_custom_call cost estimates
  assert [p.name for p in programs] == ["train step", "eval step"]
  assert train.fits and 0 < train.peak_bytes < train.hbm_bytes
  assert train.collective_bytes["all-gather"] > 0  # fsdp gathers its weights
  assert "v5e:2x2: 4 chips" in aot.report(run, setup, programs)


@needs_cuda_plugin
@pytest.mark.slow
def test_the_gpu_kernels_are_chosen_for_the_gpus():
  """On 4 H100s (XLA's description of one, no GPU) the step's attention is the Triton
  kernel: its forward and two backward kernels are Triton calls in the compiled step; the
  matmuls are the analytic count's, the memory the GPU's."""
  run, setup, programs = _compile("h100-4", mesh="fsdp=2,tensor=2", model__d_model=128,
                                  model__n_heads=4, model__n_kv_heads=2, model__remat="none")
  train, evaluate = programs
  layers = run.model.n_layers  # XLA:GPU unrolls the short layer loop
  assert (train.kernel_calls, evaluate.kernel_calls) == (3 * layers, layers), (
      train.kernel_calls, evaluate.kernel_calls)
  assert train.fits and 0 < train.peak_bytes < train.hbm_bytes
  assert train.collective_bytes["all-gather"] > 0  # fsdp gathers its weights
  matmuls = train.flops * 4 / aot.model_flops_per_step(run, attention=False)
  assert 0.95 < matmuls < 1.3, matmuls  # attention's own matmuls are in the Triton kernels
  assert "h100:1x1x4: 4 chips" in aot.report(run, setup, programs)


@needs_libtpu
@pytest.mark.slow
def test_composed_run_compiles_for_an_8_chip_slice():
  """2 DiLoCo replicas x 2 stages (1F1B, vocabulary parallelism) x 2 context shards: train
  step, eval step and outer sync, each within a v5e chip's HBM."""
  run, _, programs = _compile(
      "v5e-8", mesh="replica=2,stage=2,context=2", outer__name="diloco",
      pipeline__schedule="1f1b", pipeline__microbatches=2, pipeline__vocab_parallel=True)
  assert [p.name for p in programs] == ["train step", "eval step", "outer sync"]
  assert all(p.fits for p in programs)
  assert programs[0].collective_bytes["collective-permute"] > 0  # stages and ring hops
  assert programs[2].collective_bytes["all-reduce"] > 0  # the sync averages the replicas
  assert 0.3 < aot.recompute_bound(run, programs[0]) < 1.0  # replicas and stages recompute


@needs_libtpu
@pytest.mark.slow
def test_compiled_flops_are_the_model_s():
  """Without remat, the step's matmul FLOPs on the slice (convolutions counted by the taps
  that meet input, loops in full) are the analytic 6N + causal attention to within 5%
  (XLA's blockwise attention, which skips blocks above the diagonal); full remat runs the
  layers' forward again: more than 15% added, at most the 1/3 of a layer's forward."""
  def ratio(remat):  # the train step alone: its eval step adds nothing here
    slice_ = chips.slice_devices("v5e:2x2")
    run = config_check.check_config(load_test_config(
        "stdlib", mesh="fsdp=4", model__d_model=256, model__n_heads=4, model__n_kv_heads=2,
        model__d_ff=768, model__n_layers=2, model__attention_impl="xla", model__remat=remat,
        data__seq_len=256, data__batch_size=4), devices=slice_.devices)
    setup = make_setup(run, mesh_lib.make_mesh(run.mesh, slice_.devices))
    lowered = setup.train_fn.lower(aot._abstract(setup.abstract, setup.state_sh),
                                   aot._batch(run, setup.batch_sh))
    return aot.measure("train step", lowered.compile(), slice_).flops * 4 / (
        aot.model_flops_per_step(run))
  plain, full = ratio("none"), ratio("full")
  assert plain == pytest.approx(1.0, abs=0.05)
  assert 1.15 * plain < full <= 4 / 3 * plain



@needs_libtpu
def test_fsdp_moves_weights_not_activations():
  """fsdp=8 on a v5e slice, full remat, bf16: the step sends what FSDP must (each layer's
  weights gathered for the forward, its rerun and the backward; the gradients reduced)
  and no collective of activations: none larger than the largest parameter. Without the
  residual stream's batch sharding between layers the partitioner all-reduced and
  all-gathered [B, T, d_ff] activations instead: 156.8 MB against 25.0."""
  _, setup, lowered = _lowered_step("v5e:2x4", mesh="fsdp=8", data__batch_size=8)
  text = lowered.compile().as_text()
  params = jax.tree.leaves(setup.abstract.params)
  n = sum(x.size for x in params)
  gather_pass, grads = n * 2 * 7 / 8, n * 4 * 2 * 7 / 8  # bf16 all-gather, f32 all-reduce
  sent = comm_bytes.collective_bytes_from_hlo(text, 8, trips=True)
  assert sent <= 1.25 * (3 * gather_pass + grads), sent / (3 * gather_pass + grads)
  # No collective moves an array larger than the largest parameter (XLA may combine
  # several gradients into one tuple all-reduce: each of its arrays is checked).
  largest = max(x.size for x in params)
  for line in text.splitlines():
    if re.search(r" (?:all-reduce|all-gather|reduce-scatter)(?:-start)?\(", line):
      result = line.split(" = ", 1)[1].split(" all-", 1)[0].split(" reduce-scatter", 1)[0]
      for dims in re.findall(r"\w+\[([\d,]*)\]", result):
        assert math.prod(int(d) for d in dims.split(",") if d) <= largest, line[:200]

def test_trip_count_reads_tpu_loop_conditions():
  """A TPU while loop records no known_trip_count: its condition's bound over the body's
  step is the count (a windowed einsum's loop steps by 2)."""
  condition = [
      "  %constant.1 = u32[]{:T(128)} constant(16)",
      "  %p = (u32[], f32[4]) parameter(0)",
      "  %gte = u32[]{:T(128)} get-tuple-element(%p), index=0",
      "  ROOT %lt = pred[]{:T(512)} compare(%gte, %constant.1), direction=LT"]
  body = [
      "  %two = u32[]{:T(128)} constant(2)",
      "  %q = (u32[], f32[4]) parameter(0)",
      "  %i = u32[]{:T(128)} get-tuple-element(%q), index=0",
      "  %x = f32[4]{0} get-tuple-element(%q), index=1",
      "  %next = u32[]{:T(128)} add(%i, %two)",
      "  ROOT %t = (u32[], f32[4]) tuple(%next, %x)"]
  line = "  %while.1 = (u32[], f32[4]) while(%t0), condition=%cond, body=%body"
  assert hlo_flops.trip_count(line, {"cond": condition, "body": body}) == 8
  assert hlo_flops.trip_count(line, {"cond": condition, "body": body[:4] + [
      "  %next = u32[]{:T(128)} add(%i, %one)", "  ROOT %t = (u32[], f32[4]) tuple(%next, %x)"]
      }) == 16  # a step that is not a constant: 1
  assert hlo_flops.trip_count(line.replace("%cond", "%other"), {"cond": condition}) is None


@pytest.mark.parametrize("argv,message", [
    (["--topology=v9-8"], "error: topology='v9-8' is not a TPU slice"),
    (["--topology=v5e-8", "--config.mesh=data=16"],
     "error: mesh data=16 needs 16 devices"),
])
def test_bad_input_is_one_line(argv, message, tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "experiments.compile", "--config=configs/tiny_lm.py:size=test",
       *argv], capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(
           os.path.dirname(os.path.abspath(__file__)))), timeout=300)
  assert result.returncode == 1
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and errors[0].startswith(message), result.stderr[-2000:]
  assert "Traceback" not in result.stderr


def test_no_libtpu_is_one_line(monkeypatch):
  monkeypatch.setitem(sys.modules, "libtpu", None)  # import libtpu raises ImportError
  with pytest.raises(RuntimeError, match=r"needs libtpu, which is not installed: pip install"):
    chips.slice_devices("v5e-8")


def test_no_cuda_plugin_is_one_line(monkeypatch):
  for cuda in ("12", "13"):
    monkeypatch.setitem(sys.modules, f"jax_plugins.xla_cuda{cuda}", None)
  with pytest.raises(RuntimeError, match=r"needs jax's CUDA plugin, which is not installed: pip"):
    chips.slice_devices("h100-8")



@needs_libtpu
@pytest.mark.slow
def test_a_step_that_does_not_fit_is_reported():
  """The TPU compiler refuses a step that needs more HBM than the chip has: the report says
  how much it needs and what would need less, and the other programs are still measured."""
  run, setup, programs = _compile("v5e:2x2", mesh="data=4", data__batch_size=512,
                                  data__seq_len=8192, model__remat="none")
  train = programs[0]
  assert isinstance(train, aot.Overflow) and not train.fits
  assert train.needed_bytes > train.available_bytes > 15 * 2 ** 30
  text = aot.report(run, setup, programs)
  assert "train step, per device:\n  DOES NOT FIT: the compiler needs" in text
  assert "--config.model.remat=minimal, dots, qkv or full" in text


@needs_libtpu
@pytest.mark.slow
def test_offload_moves_saved_activations_to_host():
  """Full remat with the layer input and q, k, v offloaded (MaxText's v6e recipe): the
  compiled v5e step keeps them in pinned host memory, and its device temporaries shrink."""
  def memory(offload):
    _, _, lowered = _lowered_step(
        "v5e:2x2", mesh="fsdp=4", model__remat_offload=offload, model__n_layers=4,
        model__d_ff=512, data__batch_size=8)  # 2 rows a device: libtpu's compile grows with rows
    analysis = lowered.compile().memory_analysis()
    return ("pinned_host" in lowered.as_text(), analysis.temp_size_in_bytes,
            analysis.host_temp_size_in_bytes)

  kept, offloaded = memory(""), memory("layer_input,q,k,v")
  assert not kept[0] and kept[2] == 0
  # 4 layers x 2 rows x 256 tokens x (256 + 256 + 2 x 128) bf16 values a device.
  assert offloaded[0] and offloaded[2] >= 4 * 2 * 256 * 768 * 2
  assert offloaded[1] < kept[1]


@needs_libtpu
@pytest.mark.slow
def test_accumulation_gathers_the_weights_once():
  """fsdp=8, 4 accumulation steps, bf16: gathered in every microbatch, the matmul weights
  cross the links 4 x 3 times (forward, its rerun, backward); with `accum_gather_once`,
  once, in the compute dtype: their all-gathers send one pass of those weights."""
  def gathered(once):
    run, setup, lowered = _lowered_step("v5e:2x4", mesh="fsdp=8", data__batch_size=32,
                                        optimizer__grad_accum_steps=4,
                                        optimizer__accum_gather_once=once)
    text = lowered.compile().as_text()
    view = jax.eval_shape(lambda p: transformer.compute_view(run.model, p), setup.abstract.params)
    weights = sum(x.size * 2 for x in jax.tree.leaves(view) if x.dtype == jax.numpy.bfloat16)
    # The weights' gathers, not the token ids' (a few KB a microbatch, in every step).
    floats = "\n".join(line for line in text.splitlines()
                       if " all-gather" not in line or "s32[" not in line.split(" all-gather")[0])
    return comm_bytes.collective_bytes_from_hlo(floats, 8, trips=True, kind="all-gather"), (
        weights * 7 / 8)

  (each, one_pass), (once, _) = gathered(False), gathered(True)
  assert one_pass <= once <= 1.1 * one_pass, once / one_pass
  assert each >= 6 * one_pass, each / one_pass


@pytest.mark.parametrize("name,wrap", [("v5p-128", (True,) * 3), ("v5p-64", (False,) * 3),
                                       ("v4:4x4x8", (True,) * 3), ("v6e-256", (True, True, False)),
                                       ("v6e:8x16", (False, True, False)), ("v5e-8", (False,) * 3)])
def test_slices_wrap_around_as_cloud_tpu_builds_them(name, wrap):
  assert chips.wraparound(*chips.parse(name)) == wrap


@needs_libtpu
@pytest.mark.slow
def test_64_chip_fsdp_gathers_are_all_gathers(monkeypatch):
  """fsdp=64 on v5p-128 (a 4x4x4 torus), bf16, full remat: the weights move by all-gather,
  each layer's twice a step (as MaxText's), and the one all-reduce is the gradients'.
  Described without its wraparound links, libtpu writes every gather as an all-reduce of
  a zero-padded buffer instead (2x the bytes)."""
  def sent():
    _, setup, lowered = _lowered_step("v5p-128", mesh="fsdp=64", data__batch_size=64)
    text = lowered.compile().as_text()
    params = setup.abstract.params
    one_pass = sum(x.size for x in jax.tree.leaves(params)) * 2 * 63 / 64  # bf16, ring
    # What FSDP must gather: each layer's matmul weights for the forward and once more for
    # the rerun forward and the backward together, the output layer's once (its backward
    # keeps the gathered copy); the embedding is looked up where it lies.
    layers = sum(x.size for k, x in params["layers"].items() if not k.endswith("norm"))
    must = (2 * layers + params["unembedding"].size) * 2 * 63 / 64
    return {k: comm_bytes.collective_bytes_from_hlo(text, 64, trips=True, kind=k)
            for k in ("all-gather", "all-reduce")}, one_pass, must

  torus, one_pass, must = sent()
  assert must <= torus["all-gather"] <= 1.03 * must, torus["all-gather"] / must
  assert torus["all-reduce"] <= 2.1 * one_pass, torus  # the bf16 gradients' ring all-reduce
  monkeypatch.setattr(chips, "wraparound", lambda chip, shape: (False,) * 3)
  mesh, _, _ = sent()
  assert mesh["all-gather"] == 0 and mesh["all-reduce"] > 4 * one_pass, mesh
