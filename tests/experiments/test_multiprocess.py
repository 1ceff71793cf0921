"""Two processes on loopback (4 CPU devices each) train as one 8-device run: real collectives."""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import fork_server
from jaxsys import xla_flags
from jaxsys.checkpoint.manager import Checkpointer
from jaxsys.lab.launch import free_port

pytestmark = pytest.mark.slow  # starts processes

ROOT = pathlib.Path(__file__).resolve().parents[2]



def _rows(workdir):
  return [json.loads(l) for l in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def _losses(workdir):
  return {r["step"]: r["loss"] for r in _rows(workdir) if "loss" in r}


def _base_flags(small_corpus, *extra):
  # The evaluation runs across the processes on one validation batch (8 cost ~1.3 s a run).
  return ["--config=configs/tiny_lm.py:size=test", f"--config.data.source={small_corpus}",
          "--config.data.num_threads=0", "--config.total_steps=4", "--config.log_every=1",
          "--config.eval_every=4", "--config.eval_steps=1", *extra]


def _devices(n: int) -> dict[str, str]:
  """The environment with n CPU devices, the suite's other XLA flags kept (cheap compiles)."""
  return dict(os.environ, XLA_FLAGS=xla_flags.with_cpu_devices(n))


@pytest.fixture
def server(tmp_path):
  """The test's runs of experiments.train, each a child forked from one start-up of it
  (tests/experiments/fork_server.py: ~2.5 s of CPU less than a process each), with its own
  devices and jax.distributed environment: separate processes still, joined on loopback."""
  with fork_server.Server(tmp_path / "forked") as server:
    yield server


def run_single(server, flags, workdir, devices: int = 8):
  """experiments.train in one process with `devices` CPU devices (the conftest's 8)."""
  proc = server.run([*flags, f"--workdir={workdir}"],
                    env={"XLA_FLAGS": xla_flags.with_cpu_devices(devices)})
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def start_two_processes(server, flags, workdir, local_devices: int = 4):
  """experiments.train as 2 processes x `local_devices` CPU devices joined by
  jax.distributed on loopback."""
  port = free_port()
  return [server.start([*flags, f"--workdir={workdir}"],
                       env={"XLA_FLAGS": xla_flags.with_cpu_devices(local_devices),
                            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                            "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(pid)})
          for pid in range(2)]


def finish(procs, returncode=0):
  """(stdout, stderr) of each process, once all exited with `returncode`."""
  outputs = [p.communicate(timeout=300) for p in procs]
  for p, (_, err) in zip(procs, outputs):
    assert p.returncode == returncode, err[-3000:]
  assert "8 devices (4 local), process 1 of 2" in outputs[1][1]
  return outputs


def run_two_processes(server, flags, workdir):
  return finish(start_two_processes(server, flags, workdir))


def test_two_processes_match_one(server, small_corpus, tmp_path):
  """Stage 0 on one process, stage 1 on the other, each stage's parameters sharded over its
  process's 4 devices (fsdp): activations, gradients and the vocabulary collectives cross
  processes, and each process saves its own pieces. (Rows split between processes: the runs
  below, on data=2,fsdp=4 and on replicas, one a process.)"""
  outputs = run_two_processes(server, _base_flags(small_corpus, "--config.mesh=stage=2,fsdp=4",
                                                  "--config.pipeline.schedule=1f1b",
                                                  "--config.pipeline.microbatches=2",
                                                  "--config.pipeline.vocab_parallel=true"),
                              tmp_path / "multi")
  assert all("local batch 16 of 16" in err for _, err in outputs)  # each holds one whole stage
  run_single(server, _base_flags(small_corpus, "--config.mesh=data=8"), tmp_path / "one")
  a, b = _losses(tmp_path / "one"), _losses(tmp_path / "multi")
  assert sorted(a) == sorted(b) == [1, 2, 3, 4]
  # Same global batches, so the same losses: pipelining and sharding the parameters change
  # no loss (stage=2,fsdp=4 over two processes against data=8 in one).
  np.testing.assert_allclose([b[s] for s in a], [a[s] for s in a], rtol=1e-5)
  assert Checkpointer(str(tmp_path / "multi" / "checkpoints")).all_steps() == [4]
  # Each process wrote its own pieces of the state (orbax's per-process ocdbt stores), its
  # stage's share of the split arrays, never the whole state gathered on one. (Process 0
  # writes more: arrays the saved layout replicates, under a MiB a replica, are written
  # whole by one replica; 65/35 here.)
  state = tmp_path / "multi" / "checkpoints" / "4" / "state"
  sizes = [sum(f.stat().st_size for f in (state / f"ocdbt.process_{i}").rglob("*") if f.is_file())
           for i in range(2)]
  assert all(0.25 < s / sum(sizes) < 0.75 for s in sizes), sizes


_GLOBAL_BATCH = """
import os, sys, jax, numpy as np
jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], 2,
                           int(os.environ["JAX_PROCESS_ID"]))
from jaxsys import mesh as mesh_lib
from jaxsys.train import step
rows = np.arange(4 * 8, dtype=np.int32).reshape(4, 8)  # what each process's loader read
batch = step.global_batch({"inputs": rows}, mesh_lib.batch_sharding(mesh_lib.make_mesh(sys.argv[1])))
(shard,) = batch["inputs"].addressable_shards
print(batch["inputs"].shape, shard.data[0].tolist())
"""


def test_a_sequence_split_across_processes_is_each_device_s_slice_of_whole_rows():
  """context=2 with one device a process: each process loads the whole rows, and its device
  holds its half of each (jax alone would take each process's rows for its half of rows
  twice as long: (4, 16))."""
  port = free_port()
  procs = [subprocess.Popen([sys.executable, "-c", _GLOBAL_BATCH, "context=2"], cwd=ROOT,
                            env=dict(_devices(1), JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                     JAX_PROCESS_ID=str(i), JAX_PLATFORMS="cpu"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outputs = [p.communicate(timeout=120) for p in procs]
  assert all(p.returncode == 0 for p in procs), outputs[0][1][-2000:]
  assert [out.strip().splitlines()[-1] for out, _ in outputs] == [
      "(4, 8) [0, 1, 2, 3]", "(4, 8) [4, 5, 6, 7]"]


def test_sigterm_to_one_process_stops_both_at_one_step(server, small_corpus, tmp_path):
  """Only process 1 gets SIGTERM: both agree on a step, save it together and exit 75."""
  flags = ["--config=configs/tiny_lm.py:size=test", f"--config.data.source={small_corpus}",
           "--config.data.num_threads=0", "--config.total_steps=100000", "--config.log_every=1",
           "--config.eval_every=0", "--config.checkpoint_every=100000",
           "--config.mesh=data=2,fsdp=4"]
  workdir = tmp_path / "run"  # beside the server's files
  procs = start_two_processes(server, flags, workdir)
  deadline = time.monotonic() + 240
  while not (workdir / "metrics.jsonl").exists() or max(_losses(workdir), default=0) < 3:
    assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, \
        procs[1].communicate()[1][-3000:]
    time.sleep(0.2)
  procs[1].send_signal(signal.SIGTERM)
  (out, _), _ = finish(procs, returncode=75)
  saved = Checkpointer(str(workdir / "checkpoints")).all_steps()
  assert len(saved) == 1 and saved[0] == max(_losses(workdir)) >= 3
  assert f"preempted at step {saved[0]} by SIGTERM" in out and "done" not in out


def test_composed_run_killed_resumes_merged_under_another_composition(server, small_corpus,
                                                                     tmp_path):
  """Five axes, 16 devices: DiLoCo (int8-compressed syncs) over 2 replicas x 2 pipeline
  stages (1F1B, vocabulary parallelism) x 2 context shards x 2 tensor shards, in two
  processes (a replica each: the sync's all-reduce crosses them), SIGKILLed; resumed by one
  process as one model on stage=4,context=2,tensor=2 (replicas merged by their mean).
  Until the kill the two processes' losses, evaluations and bytes are a straight
  one-process run's of the same composition. Checkpoints follow syncs, when the replicas
  are equal, so the merged run's first loss equals that run's at the step too."""
  composed = ["--config.mesh=replica=2,stage=2,context=2,tensor=2",
              "--config.outer.name=diloco", "--config.outer.sync_every=2",
              "--config.outer.compression=int8", "--config.pipeline.schedule=1f1b",
              "--config.pipeline.microbatches=2", "--config.pipeline.vocab_parallel=true"]
  # Batches of 8 rows of 32 tokens (size=test's 16 of 64: a step on 16 devices cost ~0.8 s
  # of CPU) and one batch an evaluation: the comparisons need no more.
  common = ["--config=configs/tiny_lm.py:size=test", f"--config.data.source={small_corpus}",
            "--config.data.num_threads=0", "--config.data.batch_size=8",
            "--config.data.seq_len=32", "--config.model.n_layers=4", "--config.log_every=1",
            "--config.eval_every=2", "--config.eval_steps=1", "--config.checkpoint_every=2",
            "--config.optimizer.schedule_steps=8", "--config.optimizer.warmup_steps=2"]
  # 5 steps: the kill comes once step 4 is committed (two syncs, the second with the outer
  # momentum of the first), so the resume is from step 4 and its first step, 5, is one the
  # straight run has too.
  run_single(server, [*common, *composed, "--config.total_steps=5"], tmp_path / "straight",
             devices=16)
  merged = tmp_path / "merged"
  procs = start_two_processes(server, [*common, *composed, "--config.total_steps=100000"],
                              merged, local_devices=8)
  deadline = time.monotonic() + 240
  while not (merged / "checkpoints" / "4").is_dir():  # a step's directory is its commit
    assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, \
        procs[1].communicate()[1][-3000:]
    time.sleep(0.2)
  for p in procs:
    p.send_signal(signal.SIGKILL)
    p.communicate()
  killed_at = max(_losses(merged))
  proc = run_single(server, [*common, "--config.mesh=stage=4,context=2,tensor=2",
                             "--config.pipeline.schedule=1f1b", "--config.pipeline.microbatches=4",
                             "--config.total_steps=5"], merged, devices=16)
  resumed = int(re.search(r"resumed from \S+ at step (\d+)", proc.stderr)[1])
  assert resumed >= 4 and resumed % 2 == 0 and "replicas merged by mean" in proc.stderr
  a, b = _losses(tmp_path / "straight"), _losses(merged)
  assert sorted(b) == list(range(1, 6)) and killed_at >= resumed
  np.testing.assert_allclose(b[resumed + 1], a[resumed + 1], rtol=1e-5)
  np.testing.assert_allclose([b[s] for s in range(1, resumed + 1)],
                             [a[s] for s in range(1, resumed + 1)], rtol=1e-5)
  # The evaluations and the bytes the syncs moved, up to the resumed step (after each sync).
  evals = lambda w: {r["step"]: (r["val_bpb"], r["comm_bytes"]) for r in _rows(w)
                     if "val_bpb" in r and r["step"] <= resumed}
  a, b = evals(tmp_path / "straight"), evals(merged)
  assert sorted(a) == sorted(b) and len(a) >= 2
  np.testing.assert_allclose([b[s][0] for s in a], [a[s][0] for s in a], rtol=1e-5)
  assert [b[s][1] for s in a] == [a[s][1] for s in a]
