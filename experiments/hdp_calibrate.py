r"""The HDP simulator's cost model against a measured ring-attention step over a real link.

  python -m experiments.hdp_calibrate --bandwidths=50mbit,100mbit,none --out=/tmp/hdp_cal.json

Fits jaxsys/parallel/hdp_sim.py's compute rates on this CPU (`fit_cost_model`, as
`bench_hdp --part=sim` does), then trains a small MHA model (d 192, 2 layers, SwiGLU d_ff
512 = 8/3 d, so its shape is hdp_sim.dense_params'; float32) with context parallelism over
two processes of one CPU device each (`--config.mesh=context=2`: ring attention, zigzag,
two 4096-token rows a step, one loaded by each process), joined by the network lab's link
(jaxsys/lab; `--topology switched` by default: each process its own link of the rate each
way, which is what the simulator's `link_bytes_per_s` is, one direction of one device's
link). The corpus is 200 slices of 128 KB of the stdlib's text, so nearly every row is
one document and the ring's attention is one causal 4096-token sequence a row (what the
simulator counts for it).

Each case is predicted by the simulator's own static path (`hdp_sim.simulate_static` with
two rows of seq_len on a ring of 2: ring member, its hops, the layout all-gather, the
gradient all-reduce) with the link at the shaped rate's TCP payload rate (the rate less
66 bytes of headers a 1448-byte segment, jaxsys.lab.physics), and for `none` the path's
unshaped capacity (--unshaped_mbit, calibrated in docs/results/network_lab.md; not fitted
here). A first case, `in-process`, runs the same program on two devices of one process
(the collectives in memory): the compute alone, predicted with an unlimited link; each
lab case's communication is its step less that. Two predictions (MODELS): the simulator
as bench_hdp runs it (hops overlapped, every member sending at once) and as this backend
runs a step (collectives in line, a collective-permute's two directions one after the
other: CostModel(overlap=False, hop_exchange=2)).
Needs root and iproute2 for the shaped links.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import time

import numpy as np
from absl import app, flags

from jaxsys import xla_flags
from jaxsys.lab import link as link_lib, physics, run
from jaxsys.parallel import hdp_sim

# The measured model: MHA (kv_dim = d), SwiGLU d_ff = 8/3 d, so hdp_sim's 24 d^2 matmul
# FLOPs a token and dense_params hold for it.
MODEL = dict(d_model=192, n_layers=2, n_heads=3, n_kv_heads=3, d_ff=512)
VOCAB = 256
IN_PROCESS = "in-process"
# The unshaped paths' rates on this VM as docs/results/network_lab.md calibrated them on a
# data-parallel all-reduce. Large collective-permutes crossed the switched path at up to
# 1.44 Gbit/s (docs/results/context_and_hdp.md): the capacity depends on what the cores
# do, so a `none` case predicted with it is not a test.
UNSHAPED_MBIT = {"switched": 258.0, "shared": 633.0}


def make_corpus(directory: str, *, files: int = 200, size: int = 131072) -> str:
  """`files` text files of `size` bytes each, slices of the stdlib's .py text in path order
  (rows of up to `size` tokens hold one document, bar the slice boundaries)."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  text = bytearray()
  for path in sorted(root.rglob("*.py")):
    if "site-packages" not in path.parts:
      text += path.read_bytes()
      if len(text) >= files * size:
        break
  if len(text) < files * size:
    raise ValueError(f"make_corpus: the stdlib holds {len(text)} bytes, fewer than "
                     f"files={files} x size={size}")
  out = pathlib.Path(directory)
  shutil.rmtree(out, ignore_errors=True)
  out.mkdir(parents=True)
  for i in range(files):
    (out / f"part{i:03d}.txt").write_bytes(bytes(text[i * size:(i + 1) * size]))
  return str(out)


def runner_args(workdir: str, corpus: str, *, seq_len: int, steps: int, ring: int = 2,
                rows: int = 2, model: dict = MODEL) -> tuple[str, ...]:
  """The trainer's flags for one case: `rows` rows of seq_len a step on `context=ring`
  (over any number of processes: each loads the whole rows, and `step.global_batch` gives
  each device its slice of them)."""
  shutil.rmtree(workdir, ignore_errors=True)
  return ("--config=configs/tiny_lm.py:size=test", f"--config.total_steps={steps}",
          "--config.log_every=1", "--config.eval_every=0", "--config.checkpoint_every=0",
          f"--config.data.batch_size={rows}",
          f"--config.data.seq_len={seq_len}",
          f"--config.data.source={corpus}", f"--config.mesh=context={ring}",
          *(f"--config.model.{k}={v}" for k, v in model.items()), f"--workdir={workdir}")


def payload_rate(bits_per_s: float) -> float:
  """TCP payload bytes a second through a link of `bits_per_s` (Ethernet, IPv4 and TCP
  headers on every full segment)."""
  return bits_per_s / 8 * physics.MSS / (physics.MSS + link_lib.HEADER_BYTES)


def cost_model(fit: hdp_sim.Fit, *, link_bytes_per_s: float, overlap: bool = True,
               hop_exchange: float = 1.0, model: dict = MODEL) -> hdp_sim.CostModel:
  """The fitted rates for the measured model: float32, MHA, compiled collectives, its
  parameters' gradients all-reduced."""
  d, layers = model["d_model"], model["n_layers"]
  kv_dim = d * model["n_kv_heads"] // model["n_heads"]
  return dataclasses.replace(
      fit.model, link_bytes_per_s=link_bytes_per_s, d_model=d, n_layers=layers, kv_dim=kv_dim,
      bytes_per_element=4, overlap=overlap, pad_compute=True, compiled=True,
      params=hdp_sim.dense_params(d, layers, kv_dim, VOCAB), hop_exchange=hop_exchange)


# The two models each case is predicted with: the simulator as its tables run it (hops
# overlapped with compute, every member sending at once), and as this backend runs a step
# (XLA:CPU runs a program's collectives in line, and its collective-permute over gloo
# moves the two directions one after the other).
MODELS = {"simulator": dict(overlap=True, hop_exchange=1.0),
          "cpu_backend": dict(overlap=False, hop_exchange=2.0)}


def predict(model: hdp_sim.CostModel, *, seq_len: int, ring: int = 2, rows: int = 2) -> dict:
  """Seconds of one step (`rows` rows of seq_len, one after another on a ring of `ring`:
  the program runs them as one batch, the same compute and bytes) by hdp_sim's static
  path, split into compute (an unlimited link) and communication, and the bytes each
  device sends."""
  kw = dict(num_devices=ring, tokens_per_device=seq_len // ring, max_len=seq_len)
  lengths = [seq_len] * rows
  whole = hdp_sim.simulate_static(lengths, model=model, **kw)
  free = hdp_sim.simulate_static(lengths, model=dataclasses.replace(
      model, link_bytes_per_s=1e30), **kw)
  return dict(total_s=whole.time, compute_s=free.time, comm_s=whole.time - free.time,
              sent_bytes=float(sum(whole.sent.values())), sent=whole.sent)


def link_rate(bandwidth: str, topology: str, unshaped_mbit: float | None = None) -> float:
  """Payload bytes a second of one device's link for a lab --bandwidth (none: the path's
  unshaped capacity), per direction: on the shared link the two devices' sends share it."""
  bits = link_lib.parse_rate(bandwidth)
  cap = (unshaped_mbit or UNSHAPED_MBIT[topology]) * 1e6
  rate = payload_rate(min(bits, cap) if bits else cap)
  return rate / 2 if topology == "shared" else rate


def measure_lab(bandwidth: str, args: tuple[str, ...], topology: str) -> dict:
  """One lab run's summary (step_time_s: median after the compiling step)."""
  return run.run_lab(run.LabConfig(processes=2, bandwidth=bandwidth, runner_args=args,
                                   topology=topology), echo=False)


def measure_in_process(args: tuple[str, ...], ring: int = 2) -> list[float]:
  """Step times (after the first) of the same program on `ring` devices of one process."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags.with_cpu_devices(ring))
  subprocess.run([sys.executable, "-m", run.RUNNER, *args], env=env, check=True,
                 capture_output=True)
  return [t for _, t in run.step_times(args[-1].split("=", 1)[1])]


def table(rows: list[dict]) -> str:
  """Markdown: each case's predictions (MODELS) and measurement, and their errors; then
  compute and communication apart (measured compute: the in-process case's step)."""
  lines = ["| case | link (payload MB/s a device) | predicted: simulator (s) | predicted: "
           "CPU backend (s) | measured (s, median [min, max]) | error: simulator | error: CPU "
           "backend | compute predicted / measured (s) | communication: simulator / CPU "
           "backend / measured (s) | bytes a device: simulated / compiled |",
           "|---|---:|---:|---:|---|---:|---:|---|---|---:|"]
  for r in rows:
    lo, hi = r["measured_min_max_s"]
    compiled = (f"{r['sent_bytes'] / r['compiled_bytes']:.3f}" if r.get("compiled_bytes")
                else "-")
    comm = r.get("measured_comm_s")
    lines.append(
        f"| {r['case']} | {r['link_MBps']:.2f} | {r['simulator_s']:.3f} | "
        f"{r['cpu_backend_s']:.3f} | {r['measured_s']:.3f} [{lo:.3f}, {hi:.3f}] | "
        f"{r['error_simulator']:+.1%} | {r['error_cpu_backend']:+.1%} | "
        f"{r['compute_s']:.3f} / {r.get('measured_compute_s', float('nan')):.3f} | "
        f"{r['simulator_comm_s']:.3f} / {r['cpu_backend_comm_s']:.3f} / "
        f"{'-' if comm is None else f'{comm:.3f}'} | {compiled} |")
  return "\n".join(lines)


def case_row(case: str, fit: hdp_sim.Fit, rate: float, steps_s, *, seq_len: int,
             compiled_bytes: float | None = None, measured_compute_s: float | None = None
             ) -> dict:
  """One table row: each of MODELS' predictions at `rate` payload bytes/s against the
  measured steps (median); with the measured compute, the measured communication is the
  step less it."""
  measured = float(np.median(steps_s))
  row = dict(case=case, link_MBps=rate / 1e6 if rate < 1e29 else float("inf"),
             measured_s=measured,
             measured_min_max_s=[float(np.min(steps_s)), float(np.max(steps_s))],
             steps_s=[float(t) for t in steps_s], compiled_bytes=compiled_bytes)
  for name, kw in MODELS.items():
    p = predict(cost_model(fit, link_bytes_per_s=rate, **kw), seq_len=seq_len)
    row.update({f"{name}_s": p["total_s"], f"{name}_comm_s": p["comm_s"],
                f"error_{name}": p["total_s"] / measured - 1})
    row.update(compute_s=p["compute_s"], sent_bytes=p["sent_bytes"], sent=p["sent"])
  if measured_compute_s is not None:
    row.update(measured_compute_s=measured_compute_s,
               measured_comm_s=measured - measured_compute_s)
  return row


_BANDWIDTHS = flags.DEFINE_list("bandwidths", ["50mbit", "100mbit", "none"], "Lab link rates.")
_TOPOLOGY = flags.DEFINE_enum("topology", "switched", ["shared", "switched"], "The lab's network.")
_UNSHAPED = flags.DEFINE_float("unshaped_mbit", None, "The unshaped path's rate (Mbit/s); "
                               "default network_lab.md's for the topology.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 4096, "Tokens of the one row a step.")
_STEPS = flags.DEFINE_integer("steps", 6, "Training steps a case (the first compiles).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/hdp_calibrate", "Scratch directory (replaced).")
_OUT = flags.DEFINE_string("out", "/tmp/hdp_calibrate.json", "Every number (JSON).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  start = time.perf_counter()
  corpus = make_corpus(os.path.join(_WORKDIR.value, "corpus"))
  fit = hdp_sim.fit_cost_model()
  print(f"fitted on this CPU: {fit.model.sec_per_attention_flop:.3e} s per attention FLOP, "
        f"{fit.model.sec_per_linear_flop:.3e} s per linear FLOP (ratio "
        f"{fit.model.sec_per_attention_flop / fit.model.sec_per_linear_flop:.2f}); load "
        f"{os.getloadavg()[0]:.2f}", flush=True)
  args = lambda name: runner_args(os.path.join(_WORKDIR.value, name), corpus,
                                  seq_len=_SEQ_LEN.value, steps=_STEPS.value)
  compute = measure_in_process(args(IN_PROCESS))
  compute_s = float(np.median(compute))
  rows = [case_row(IN_PROCESS, fit, 1e30, compute, seq_len=_SEQ_LEN.value,
                   measured_compute_s=compute_s)]
  print(table(rows), flush=True)
  for bw in _BANDWIDTHS.value:
    try:
      s = measure_lab(bw, args(bw), _TOPOLOGY.value)
    except link_lib.LabError as e:
      raise SystemExit(f"error: {e}") from e
    steps = [t for _, t in run.step_times(os.path.join(_WORKDIR.value, bw))]
    compiled = s.get("collective_bytes_per_step")
    rows.append(case_row(f"lab {_TOPOLOGY.value} {bw}", fit,
                         link_rate(bw, _TOPOLOGY.value, _UNSHAPED.value), steps,
                         seq_len=_SEQ_LEN.value, measured_compute_s=compute_s,
                         compiled_bytes=compiled / 2 if compiled else None))
    rows[-1]["lab"] = s
    print(table(rows[-1:]).splitlines()[-1], flush=True)
  print(table(rows))
  print(f"load {os.getloadavg()[0]:.2f}; total {time.perf_counter() - start:.0f} s")
  with open(_OUT.value, "w") as f:
    json.dump(dict(fit=dict(sec_per_attention_flop=fit.model.sec_per_attention_flop,
                            sec_per_linear_flop=fit.model.sec_per_linear_flop,
                            attention_r2=fit.attention_r2, linear_r2=fit.linear_r2),
                   model=MODEL, topology=_TOPOLOGY.value, rows=rows), f, indent=1,
              default=float)


if __name__ == "__main__":
  app.run(main)
