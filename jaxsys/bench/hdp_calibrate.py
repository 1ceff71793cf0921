r"""The HDP simulator's cost model against measured ring-attention steps: compute fitted to
whole steps, then checked on held-out mixes and over a real link.

The library of `experiments/hdp_calibrate.py`: `run` measures and prints the tables
(`compute_table`, `table`) and returns every number.

The model: a small MHA model (d 192, 2 layers, SwiGLU d_ff 512 = 8/3 d, so its shape is
cost.dense_params'; float32, 256-byte vocabulary) trained with context parallelism
(`--config.mesh=context=2`: zigzag ring attention). The corpus is 200 slices of 128 KB of
the stdlib's text, so nearly every row is one document and the ring's attention is one
causal sequence a row (what the simulator counts for it).

Compute. The matmul and attention rates are first timed on this CPU by microbenchmarks
(`hdp_sim.fit_cost_model(devices=2)`: both simulated devices of this process computing at
once, as in a step). Then the same program runs on two devices of one process (the
collectives in memory: compute alone) for each mix of rows x tokens in --fit_mixes and
--heldout_mixes (different attention-to-matmul ratios and tokens a step), and
`hdp_sim.fit_step_costs` fits --terms (default: the attention rate as the ring runs it,
sec_per_element for the per-token work beside the matmuls, sec_per_step) to the fitted
mixes' whole steps, the matmul rate kept from the microbenchmark and the head's matmul
counted (CostModel.vocab_size). Each mix is predicted with the microbenchmark's rates
alone (what the simulator counted before: attention and the layers' matmuls) and with the
calibrated model; the held-out mixes were not fitted.

Communication. The --lab_mix (one of the measured mixes) then runs over two processes of
one CPU device each, joined by the network lab's link (jaxsys/lab; `--topology switched` by
default: each process its own link of the rate each way, which is what the simulator's
`link_bytes_per_s` is, one direction of one device's link), each pinned to its own core.
Each case is predicted by the simulator's own static path (`hdp_sim.simulate_static` with
the mix's rows on a ring of 2: ring member, its hops, the layout all-gather, the gradient
all-reduce) with the calibrated compute and the link at the shaped rate's TCP payload
rate (the rate less 66 bytes of headers a 1448-byte segment, jaxsys.lab.physics); for
`none` the path's unshaped capacity (--unshaped_mbit, calibrated in
docs/results/network_lab.md; not fitted here). Two link models (MODELS): the simulator as
bench_hdp runs it (hops overlapped, every member sending at once) and as this backend
runs a step (collectives in line, a collective-permute's two directions one after the
other: CostModel(overlap=False, hop_exchange=2)). Each lab case's measured communication
is its step less the in-process step of the same mix.
Needs root and iproute2 for the shaped links (--bandwidths= skips them).
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import time

import numpy as np

from jaxsys import xla_flags
from jaxsys.lab import link as link_lib, physics, run as lab_run
from jaxsys.parallel import cost, hdp_sim

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


def cost_model(rates: cost.CostModel, *, link_bytes_per_s: float, overlap: bool = True,
               hop_exchange: float = 1.0, model: dict = MODEL,
               head: bool = False) -> cost.CostModel:
  """`rates`' compute terms on the measured model: float32, MHA, compiled collectives, its
  parameters' gradients all-reduced; head: count the vocabulary head's matmul (the
  calibrated model does; the microbenchmark's rates alone, as the tables, do not)."""
  d, layers = model["d_model"], model["n_layers"]
  kv_dim = d * model["n_kv_heads"] // model["n_heads"]
  return dataclasses.replace(
      rates, link_bytes_per_s=link_bytes_per_s, d_model=d, n_layers=layers, kv_dim=kv_dim,
      bytes_per_element=4, overlap=overlap, pad_compute=True, compiled=True,
      params=cost.dense_params(d, layers, kv_dim, VOCAB), hop_exchange=hop_exchange,
      vocab_size=VOCAB if head else rates.vocab_size)


# The two models each case is predicted with: the simulator as its tables run it (hops
# overlapped with compute, every member sending at once), and as this backend runs a step
# (XLA:CPU runs a program's collectives in line, and its collective-permute over gloo
# moves the two directions one after the other).
MODELS = {"simulator": dict(overlap=True, hop_exchange=1.0),
          "cpu_backend": dict(overlap=False, hop_exchange=2.0)}


def parse_mix(text: str) -> tuple[int, int]:
  """'2x4096' -> (2 rows, 4096 tokens a row)."""
  rows, _, seq_len = text.partition("x")
  if not (rows.isdigit() and seq_len.isdigit() and int(rows) > 0 and int(seq_len) > 0):
    raise ValueError(f"mix {text!r}: must be ROWSxTOKENS, e.g. 2x4096")
  return int(rows), int(seq_len)


def measured_step(mix: str, seconds: float, ring: int = 2) -> hdp_sim.MeasuredStep:
  """A mix's in-process step as the fit takes it: its rows, each one sequence, on a ring."""
  rows, seq_len = parse_mix(mix)
  return hdp_sim.MeasuredStep((seq_len,) * rows, seconds, seq_len // ring, ring=ring, name=mix)


def predict(model: cost.CostModel, *, seq_len: int, ring: int = 2, rows: int = 2) -> dict:
  """Seconds of one step (`rows` rows of seq_len, one after another on a ring of `ring`:
  the program runs them as one batch, the same compute and bytes) by hdp_sim's static
  path, split into compute (an unlimited link) and communication, and the bytes each
  device sends."""
  kw = dict(num_devices=ring, tokens_per_device=seq_len // ring, max_len=seq_len)
  lengths = [seq_len] * rows
  whole = hdp_sim.simulate_static(lengths, model=model, **kw)
  free = hdp_sim.step_compute(model, hdp_sim.MeasuredStep(tuple(lengths), 1.0, seq_len // ring,
                                                          ring=ring))
  return dict(total_s=whole.time, compute_s=free, comm_s=whole.time - free,
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
  return lab_run.run_lab(lab_run.LabConfig(processes=2, bandwidth=bandwidth,
                                           runner_args=args, topology=topology), echo=False)


def measure_in_process(args: tuple[str, ...], ring: int = 2) -> list[float]:
  """Step times (after the first) of the same program on `ring` devices of one process."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags.with_cpu_devices(ring))
  subprocess.run([sys.executable, "-m", lab_run.RUNNER, *args], env=env, check=True,
                 capture_output=True)
  return [t for _, t in lab_run.step_times(args[-1].split("=", 1)[1])]


def _spread(steps_s) -> dict:
  return dict(measured_s=float(np.median(steps_s)),
              measured_min_max_s=[float(np.min(steps_s)), float(np.max(steps_s))],
              steps_s=[float(t) for t in steps_s])


def compute_row(mix: str, role: str, steps_s, *, rates: cost.CostModel,
                calibrated: cost.CostModel) -> dict:
  """One in-process mix: measured (median) against the microbenchmark's rates alone and the
  calibrated model (unlimited link)."""
  row = dict(case=mix, role=role, **_spread(steps_s))
  step = measured_step(mix, row["measured_s"])
  for name, m in (("rates", rates), ("calibrated", calibrated)):
    predicted = hdp_sim.step_compute(m, step)
    row.update({f"{name}_s": predicted, f"error_{name}": predicted / row["measured_s"] - 1})
  return row


def compute_table(rows: list[dict]) -> str:
  """Markdown: each in-process mix, fitted or held out, measured and predicted."""
  lines = ["| mix (rows x tokens) | role | measured (s, median [min, max]) | predicted: "
           "microbenchmark rates (s) | error | predicted: calibrated (s) | error |",
           "|---|---|---|---:|---:|---:|---:|"]
  for r in rows:
    lo, hi = r["measured_min_max_s"]
    lines.append(f"| {r['case']} | {r['role']} | {r['measured_s']:.3f} [{lo:.3f}, {hi:.3f}] | "
                 f"{r['rates_s']:.3f} | {r['error_rates']:+.1%} | {r['calibrated_s']:.3f} | "
                 f"{r['error_calibrated']:+.1%} |")
  return "\n".join(lines)


def table(rows: list[dict]) -> str:
  """Markdown: each lab case's predictions (MODELS) and measurement, and their errors; then
  compute and communication apart (measured compute: the in-process step of its mix)."""
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


def case_row(case: str, model: cost.CostModel, rate: float, steps_s, *, seq_len: int,
             rows: int = 2, compiled_bytes: float | None = None,
             measured_compute_s: float | None = None) -> dict:
  """One lab table row: `model` (its compute terms) under each of MODELS at `rate` payload
  bytes/s against the measured steps (median); with the measured compute, the measured
  communication is the step less it."""
  row = dict(case=case, link_MBps=rate / 1e6 if rate < 1e29 else float("inf"),
             compiled_bytes=compiled_bytes, **_spread(steps_s))
  measured = row["measured_s"]
  for name, kw in MODELS.items():
    p = predict(cost_model(model, link_bytes_per_s=rate, **kw), seq_len=seq_len, rows=rows)
    row.update({f"{name}_s": p["total_s"], f"{name}_comm_s": p["comm_s"],
                f"error_{name}": p["total_s"] / measured - 1})
    row.update(compute_s=p["compute_s"], sent_bytes=p["sent_bytes"], sent=p["sent"])
  if measured_compute_s is not None:
    row.update(measured_compute_s=measured_compute_s,
               measured_comm_s=measured - measured_compute_s)
  return row


def derived_7b(calibrated: cost.CostModel, tokens: int = 32768) -> dict:
  """*Derived*: the share the calibrated per-token terms (the head's matmul, sec_per_element
  scaled with d_model) add to a device's compute of one `tokens`-token sequence (a layer's
  matmuls and attention, forward and backward alike) for the tables' 7B-class model (d
  4096, 32 layers, vocabulary 32000), MHA and GQA, at this CPU's fitted rates. Not
  sec_per_step: the fixed cost of this 0.98M-parameter model's steps does not scale to 7B."""
  out = {}
  for name, kv_dim in (("MHA", 4096), ("GQA", 1024)):
    plain = dataclasses.replace(calibrated, d_model=4096, n_layers=32, kv_dim=kv_dim,
                                vocab_size=0, sec_per_element=0.0, tensor=1)
    full = dataclasses.replace(plain, vocab_size=cost.VOCAB_SIZE,
                               sec_per_element=calibrated.sec_per_element)
    base = float(plain.linear(tokens) + plain.attention(tokens))
    head = float(dataclasses.replace(plain, vocab_size=cost.VOCAB_SIZE).linear(tokens)
                 - plain.linear(tokens))
    other = float(full.linear(tokens) + full.attention(tokens)) - base - head
    out[name] = dict(head=head / base, element=other / base, matmul_share=float(
        plain.linear(tokens)) / base)
  return out


def mix_roles(fit_mixes, heldout_mixes) -> dict[str, str]:
  """Each measured mix -> "fitted" or "held out", the fitted first."""
  return {**{m: "fitted" for m in fit_mixes}, **{m: "held out" for m in heldout_mixes}}


def run(workdir: str, *, fit_mixes, heldout_mixes, lab_mix: str, bandwidths, topology: str,
        unshaped_mbit: float | None, terms, steps: int) -> dict:
  """The compute fit and the lab cases (see the module docstring; `workdir` is replaced),
  each result printed as it comes; returns every number. A LabError: a lab case could not
  run (or logged too few steps)."""
  mixes = mix_roles(fit_mixes, heldout_mixes)
  start, load_start = time.perf_counter(), os.getloadavg()[0]
  # Both simulated devices time the microbenchmarks at once, as the in-process steps run.
  os.environ["XLA_FLAGS"] = xla_flags.with_cpu_devices(2)
  corpus = make_corpus(os.path.join(workdir, "corpus"))
  fit = hdp_sim.fit_cost_model(devices=2)
  rates = cost_model(fit.model, link_bytes_per_s=1e30)
  print(f"microbenchmarks (2 devices at once): {rates.sec_per_attention_flop:.3e} s per "
        f"attention FLOP, {rates.sec_per_linear_flop:.3e} s per linear FLOP; load "
        f"{os.getloadavg()[0]:.2f}", flush=True)

  def args(name: str, mix: str) -> tuple[str, ...]:
    rows, seq_len = parse_mix(mix)
    return runner_args(os.path.join(workdir, name), corpus, seq_len=seq_len, rows=rows,
                       steps=steps)

  times = {}
  for mix in mixes:
    times[mix] = measure_in_process(args(f"{IN_PROCESS}-{mix}", mix))
    print(f"in-process {mix}: {np.median(times[mix]):.3f} s a step", flush=True)
  fitted = [measured_step(m, float(np.median(times[m]))) for m in fit_mixes]
  step_fit = hdp_sim.fit_step_costs(fitted, cost_model(rates, link_bytes_per_s=1e30, head=True),
                                    terms)
  calibrated = step_fit.model
  compute_rows = [compute_row(m, role, times[m], rates=rates, calibrated=calibrated)
                  for m, role in mixes.items()]
  print(compute_table(compute_rows), flush=True)
  derived = derived_7b(calibrated)
  print(f"calibrated: {', '.join(f'{t} {getattr(calibrated, t):.4g}' for t in step_fit.terms)}; "
        f"derived for the 7B-class model at 32K tokens: " + "; ".join(
            f"{k} head +{v['head']:.1%}, per-token work +{v['element']:.1%}"
            for k, v in derived.items()), flush=True)
  lab_rows = []
  lab_rows_n, lab_len = parse_mix(lab_mix)
  compute_s = float(np.median(times[lab_mix])) if bandwidths else None
  for bw in bandwidths:
    s = measure_lab(bw, args(bw, lab_mix), topology)
    lab_steps = [t for _, t in lab_run.step_times(os.path.join(workdir, bw))]
    compiled = s.get("collective_bytes_per_step")
    lab_rows.append(case_row(f"lab {topology} {bw}", calibrated,
                             link_rate(bw, topology, unshaped_mbit), lab_steps,
                             seq_len=lab_len, rows=lab_rows_n, measured_compute_s=compute_s,
                             compiled_bytes=compiled / 2 if compiled else None))
    lab_rows[-1]["lab"] = s
    print(table(lab_rows[-1:]).splitlines()[-1], flush=True)
  if lab_rows:
    print(table(lab_rows))
  load_end = os.getloadavg()[0]
  print(f"load {load_start:.2f} at the start, {load_end:.2f} at the end; total "
        f"{time.perf_counter() - start:.0f} s")
  return dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), load_start=load_start,
              load_end=load_end, model=MODEL, vocab=VOCAB, topology=topology,
              microbenchmark=dict(sec_per_attention_flop=rates.sec_per_attention_flop,
                                  sec_per_linear_flop=rates.sec_per_linear_flop,
                                  attention_r2=fit.attention_r2, linear_r2=fit.linear_r2,
                                  devices=2),
              fitted_terms=list(step_fit.terms),
              calibrated={t: getattr(calibrated, t) for t in cost.STEP_TERMS},
              fit_errors=dict(zip(fit_mixes, step_fit.errors)), derived_7b=derived,
              lab_mix=lab_mix, compute_rows=compute_rows, lab_rows=lab_rows)
