"""One lab run: a shaped link, P runner processes on it, and what crossed it per step.

  summary = run.run_lab(run.LabConfig(processes=2, bandwidth="100mbit", runner_args=(
      "--config=tiny_lm:size=test", "--config.mesh=data=2", "--workdir=/tmp/lab")))

Writes `<workdir>/lab/`: each process's log, `steps.jsonl` (per training step: wall time,
the time the link was busy, its bytes and packets), `wire.jsonl` (the link's throughput in
100 ms bins over the whole run), `summary.json` (also returned): `step_time_s` (median over
the steps after the first, which compiles), `wire_bytes_per_step` (mean over those steps),
`tokens_per_s`, `bandwidth_bps`, and the compiled train step's collective bytes when every
process has one device (then every collective byte crosses the link).
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import sys
import threading
import time

import numpy as np

from jaxsys import xla_flags
from jaxsys.lab import launch, link as link_lib, wire
from jaxsys.lab.link import LabError

RUNNER = "jaxsys.cli.train"
# The runner's compiled programs whose collectives a step runs: the train step, and an outer
# optimizer's sync (on its own or fused into the next step).
STEP_MODULE = re.compile(r"\.jit_(train_step|sync_state|sync_then_step)\.")


@dataclasses.dataclass(frozen=True)
class LabConfig:
  processes: int
  bandwidth: str  # "100mbit", "1gbit", ... or "none"
  runner_args: tuple[str, ...]  # the runner's own flags; --workdir among them
  devices_per_process: int = 1
  runner: str = RUNNER  # a module run as `python -m`
  timeout_s: float | None = None
  topology: str = "shared"  # one link all share, or "switched": a link a process


def _flag(args, name: str) -> str | None:
  """The last value of `--name=value` among `args`."""
  values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
  return values[-1] if values else None


def check(cfg: LabConfig) -> tuple[float | None, str]:
  """(rate in bits/s or None, the runner's workdir); a LabError for bad input."""
  if cfg.processes < 2:
    raise LabError(f"--processes={cfg.processes}: the lab joins at least 2 processes over "
                   "its link; use 2 or more")
  if cfg.devices_per_process < 1:
    raise LabError(f"--devices_per_process={cfg.devices_per_process}: use 1 or more")
  rate = link_lib.parse_rate(cfg.bandwidth)
  if cfg.topology not in link_lib.TOPOLOGIES:
    raise LabError(f"--topology={cfg.topology!r}: use one of {', '.join(link_lib.TOPOLOGIES)} "
                   "(one link all processes share, or a link each on a switch)")
  missing = link_lib.missing_privileges()
  if cfg.topology == "switched" and missing:
    raise LabError(f"--topology=switched puts each process in a network namespace, which needs "
                   f"{' and '.join(missing)}; --topology=shared --bandwidth=none runs unshaped")
  if rate is not None and missing:
    raise LabError(f"--bandwidth={cfg.bandwidth} shapes a link in a network namespace, which "
                   f"needs {' and '.join(missing)}; --bandwidth=none runs unshaped")
  workdir = _flag(cfg.runner_args, "workdir")
  if not workdir:
    raise LabError("the runner's flags (after --) name no --workdir=DIR; the lab writes its "
                   "measurements into DIR/lab")
  mesh = _flag(cfg.runner_args, "config.mesh")
  if mesh is not None:
    # Communication twins (CO2's all-reduce apart from the steps) take half of each
    # process's devices out of the mesh; the runner refuses an odd count in one line.
    twins = _flag(cfg.runner_args, "config.outer.comm_device") in ("True", "true", "1")
    _check_mesh(mesh, cfg.processes, cfg.devices_per_process // (1 + twins))
  return rate, workdir


def _check_mesh(spec: str, processes: int, per_process: int) -> None:
  # Here, not at the top: jax's import takes seconds, and the lab's own process needs jax
  # only to read a mesh it is given.
  from jaxsys import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  devices = processes * per_process
  try:
    sizes = [size for _, size in mesh_lib.parse_mesh_spec(spec, field="config.mesh")]
  except ValueError as e:
    raise LabError(str(e)) from e
  known = int(np.prod([s for s in sizes if s != -1]))
  fits = devices % known == 0 if -1 in sizes else known == devices
  if not fits:
    raise LabError(f"--config.mesh={spec} needs {known} devices{' or a multiple' * (-1 in sizes)}"
                   f", but --processes={processes} x --devices_per_process={per_process} give "
                   f"{devices}; choose a mesh over {devices} devices")


def _follow(path: str, done: threading.Event, out=sys.stderr) -> threading.Thread:
  """Copies what is appended to `path` to `out` until `done` (process 0's progress)."""
  def loop():
    while not os.path.exists(path) and not done.is_set():
      time.sleep(0.05)
    with open(path, errors="replace") as f:
      while True:
        line = f.readline()
        if line:
          out.write(line)
          out.flush()
        elif done.is_set():
          return
        else:
          time.sleep(0.05)
  thread = threading.Thread(target=loop, daemon=True, name="follow-process-0")
  thread.start()
  return thread


def run_lab(cfg: LabConfig, *, echo: bool = True) -> dict:
  """Runs `cfg` to the end and returns its summary (see the module's docstring); a LabError
  for bad input or a failed process. The namespace and every process are gone on return,
  also on an exception (KeyboardInterrupt included)."""
  rate, workdir = check(cfg)
  isolated = not link_lib.missing_privileges()
  out_dir = os.path.join(os.path.abspath(workdir), "lab")
  hlo_dir = os.path.join(out_dir, "hlo")
  os.makedirs(out_dir, exist_ok=True)
  link = (link_lib.Link(f"jaxsys-lab-{os.getpid()}", rate, cfg.topology, cfg.processes)
          if isolated else None)
  job = anchors = None
  done = threading.Event()
  follower = None
  try:
    if link is not None:
      link.up()
      # A process that lives in each namespace for the whole run: the sampler reads the
      # namespaces' counters through them.
      anchors = launch.start(["-c", "import time; time.sleep(1e9)"],
                             processes=len(link.namespaces), devices_per_process=1,
                             log_dir=os.path.join(out_dir, "anchor"), prefix=link.prefix)
      for p in anchors.procs:
        _wait_in_namespace(p.pid)
    before = link.counters() if link else None
    t_start = time.time()
    sampler = (wire.Sampler([p.pid for p in anchors.procs], link.device).start()
               if anchors else None)
    dump = (f" --xla_dump_to={hlo_dir} --xla_dump_hlo_as_text "
            "--xla_dump_hlo_module_re=.*step.*")
    job = launch.start(
        ["-m", cfg.runner, *cfg.runner_args], processes=cfg.processes,
        devices_per_process=cfg.devices_per_process, log_dir=out_dir,
        prefix=link.prefix if link else (lambda i: []),
        host=link.address(0) if link else "127.0.0.1",
        port=launch.COORDINATOR_PORT if link else launch.free_port(),
        first_env={"XLA_FLAGS": xla_flags.with_cpu_devices(cfg.devices_per_process) + dump})
    if echo:
      follower = _follow(job.logs[0], done)
    job.wait(cfg.timeout_s)
    samples = sampler.stop() if sampler else None
    after = link.counters() if link else None
  finally:
    done.set()
    if follower is not None:
      follower.join(timeout=2)
    for j in (job, anchors):
      if j is not None:
        j.stop()
    if link is not None:
      link.down()
  summary = summarize(cfg, rate, workdir, t_start, samples, before, after, hlo_dir)
  _prune_dump(hlo_dir)
  with open(os.path.join(out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  return summary


def _wait_in_namespace(pid: int, timeout: float = 10.0) -> None:
  """Waits until `pid` has entered another network namespace than this process's."""
  ours = os.readlink("/proc/self/ns/net")
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    try:
      if os.readlink(f"/proc/{pid}/ns/net") != ours:
        return
    except OSError:
      pass
    time.sleep(0.01)
  raise LabError(f"the lab's anchor process {pid} did not enter its namespace in {timeout} s")


def step_times(workdir: str, since: float = 0.0) -> list[tuple[int, float]]:
  """(step, seconds a step) of the runner's training rows after its first (which compiles)."""
  return [(r["step"], r["step_time_s"]) for r in _train_rows(workdir, since)]


def _train_rows(workdir: str, since: float) -> list[dict]:
  """The runner's training rows written since `since`, each with the steps it covers."""
  path = os.path.join(workdir, "metrics.jsonl")
  rows, previous = [], None
  with open(path) as f:
    for line in f:
      row = json.loads(line)
      if "loss" not in row or row.get("time", 0) < since:
        continue
      if previous is not None and "step_time_s" in row:
        rows.append(dict(row, steps=row["step"] - previous))
      previous = row["step"]
  return rows


def compiled_collective_bytes(hlo_dir: str, devices: int) -> dict[str, int]:
  """Bytes one device sends in one run of each step program XLA dumped into `hlo_dir`
  (`STEP_MODULE`), by the program's name: {"train_step": ..., "sync": ...}."""
  from jaxsys import comm_bytes  # pylint: disable=import-outside-toplevel
  sent = {}
  for path in sorted(glob.glob(os.path.join(hlo_dir, "*after_optimizations.txt"))):
    found = STEP_MODULE.search(os.path.basename(path))
    if found:
      with open(path) as f:
        sent[found.group(1)] = comm_bytes.collective_bytes_from_hlo(f.read(), devices, trips=True)
  return sent


def summarize(cfg: LabConfig, rate: float | None, workdir: str, since: float,
              samples, before, after, hlo_dir: str) -> dict:
  """The run's summary; writes steps.jsonl and wire.jsonl beside it."""
  out_dir = os.path.join(workdir, "lab")
  rows = _train_rows(workdir, since)
  if not rows:
    raise LabError(f"the runner logged fewer than 2 training steps in {workdir}/metrics.jsonl "
                   "(the first compiles); run more steps")
  steps = []
  for r in rows:
    n, end = r["steps"], r["time"]
    entry = {"step": r["step"], "steps": n, "step_time_s": r["step_time_s"], "time": end,
             "loss": r["loss"]}
    if samples is not None and len(samples) > 1:
      w = wire.window(samples, end - n * r["step_time_s"], end, rate)
      entry.update(wire_bytes=w["bytes"] / n, wire_packets=w["packets"] / n,
                   comm_s=w["busy_s"] / n)
    steps.append(entry)
  with open(os.path.join(out_dir, "steps.jsonl"), "w") as f:
    f.writelines(json.dumps(s) + "\n" for s in steps)
  times = np.array([s["step_time_s"] for s in steps])
  total_steps = sum(s["steps"] for s in steps)
  summary = {
      "processes": cfg.processes, "devices_per_process": cfg.devices_per_process,
      "topology": cfg.topology,
      "bandwidth": cfg.bandwidth, "bandwidth_bps": rate, "timed_steps": total_steps,
      "step_time_s": float(np.median(times)),
      "step_time_min_max_s": [float(times.min()), float(times.max())],
      "mean_step_time_s": float(sum(s["step_time_s"] * s["steps"] for s in steps) / total_steps),
      "tokens_per_s": float(np.median([r["tokens_per_s"] for r in rows])),
  }
  if samples is not None and len(samples) > 1:
    nbytes = sum(s["wire_bytes"] * s["steps"] for s in steps)
    packets = sum(s["wire_packets"] * s["steps"] for s in steps)
    util = wire.utilisation(samples, rate)
    with open(os.path.join(out_dir, "wire.jsonl"), "w") as f:
      f.writelines(json.dumps(u) + "\n" for u in util)
    summary.update(
        wire_bytes_per_step=nbytes / total_steps,
        # TCP's payload: the packets' bytes less their headers (pure ACKs carry none).
        wire_payload_bytes_per_step=(nbytes - packets * link_lib.HEADER_BYTES) / total_steps,
        comm_s=float(np.median([s["comm_s"] for s in steps])),
        peak_bps=max(u["bps"] for u in util) if util else 0.0,
        shaper=({k: after[k] - before[k] for k in after} if after else None))
  else:
    summary.update(wire_bytes_per_step=None, comm_s=None)
  if cfg.devices_per_process == 1:  # then every collective byte crosses the link
    programs = compiled_collective_bytes(hlo_dir, cfg.processes)
    summary["collective_bytes"] = {k: v * cfg.processes for k, v in programs.items()}
    if "train_step" in programs:
      summary["collective_bytes_per_step"] = programs["train_step"] * cfg.processes
  return summary


def _prune_dump(hlo_dir: str) -> None:
  """Keeps the step programs' optimized HLO text of XLA's dump; the rest (object files,
  LLVM IR, every small program) is megabytes no one reads."""
  for path in glob.glob(os.path.join(hlo_dir, "*")):
    keep = STEP_MODULE.search(os.path.basename(path)) and path.endswith("optimizations.txt")
    if not keep:
      shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
