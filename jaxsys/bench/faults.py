r"""Crash safety by fault injection: SIGKILL a training run at random points, resume, compare.

The library of `experiments/fault_injection.py` (its default mode; `--corruption` is
jaxsys/bench/corruption.py, `--preemption` jaxsys/bench/preemptions.py,
`--bad_input` jaxsys/bench/bad_input.py). `run` trains configs/tiny_lm.py:size=test for
`total_steps` with a checkpoint every step in <workdir>/crashed, kills it with SIGKILL
`crashes` times and starts it again each time, then lets it finish; and trains the same
config once without a kill in <workdir>/reference. Kill points (seeded by `seed`): half
land in a save cycle (a random moment after the save of a random later step has begun:
orbax's background write, its commit, the checksums and ledger entry, the next step, the
next save), one in four as such a save begins, and one in four in the start-up (a random
moment before the first save of the run before began: restore, run.lock take-over,
metrics rewrite).

Checked after each kill: what the save in flight left (orbax's temporary directory: a
step commits only with its checksums, so never a committed step without them); the
newest committed step verifies (its checksums, and its manifest against the ledger beside
the steps: the entry is durable before the step commits); the next run takes over the dead
run's run.lock and resumes from exactly that step, never unverified. At the end the crashed
run's losses (metrics.jsonl, one row per step) must equal the reference's exactly.
`summary` prints one row per crash and a summary. The `--corruption` mode runs its
undamaged and damaged runs with this module's `config_for`, `run_to_end` and `logged_losses`.

Each run is a child forked from the calling process once `prepare_parent` imported jax,
orbax, jaxsys and tensorboardX (a fresh interpreter spends about 2 s of a 3 s restart
importing), on the simulated CPU devices XLA_FLAGS names; jax's persistent compilation
cache in the workdir spares restarts the compiles. A child leads its own process group,
which the kill takes whole. Importing this module imports no jax (the `--preemption` and
`--bad_input` modes run the binary in processes of their own).
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random
import re
import signal
import sys
import time
import traceback

from jaxsys.checkpoint import ledger  # files only: no jax

TMP = ".orbax-checkpoint-tmp"
SAVE_CYCLE_S = 0.3  # kill points in a save cycle: uniform in [0, SAVE_CYCLE_S) after it began


@dataclasses.dataclass
class Crash:
  """One SIGKILL: where it landed, what it left, and what the next run made of it."""
  number: int
  plan: str  # "start-up", or "save of step N"
  killed_after_s: float  # since the fork
  pid: int
  left: str  # what the save in flight left on disk
  newest: int | None  # newest committed step after the kill
  newest_problem: str | None  # ledger.problem of it: None (verifies), else what fails
  lock_pid: int | None  # the pid run.lock names after the kill
  # Older steps failing their checksums: only ever one that orbax's max_to_keep was
  # deleting when the kill came (it deletes in place); never restored, deleted later.
  older_bad: list[str]
  next_run: str = ""  # the next run's kill point, NOTHING_SAVED (killed before any), "to the end"
  next_resumed: int | None = None  # from the next run's log; None: it logged no resume
  next_warned_unverified: bool = False
  next_took_lock: bool = False


def config_for(source: str, total_steps: int):
  """configs/tiny_lm.py:size=test, a checkpoint every step, no eval, a metrics row a step."""
  from jaxsys.configs import tiny_lm  # imports jax: called after prepare_parent
  config = tiny_lm.get_config("size=test")
  config.data.source, config.data.num_threads = source, 0
  config.total_steps, config.checkpoint_every, config.keep_checkpoints = total_steps, 1, 3
  config.eval_every, config.log_every = 0, 1
  return config


def _train(config, workdir: str, log_path: str):
  """The forked child: one training run, its absl log and stderr into `log_path`."""
  from jaxsys.train import loop  # imported by prepare_parent already
  os.setpgid(0, 0)
  fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  os.dup2(fd, 1)
  os.dup2(fd, 2)
  code = 0
  try:
    loop.train_and_evaluate(config, workdir)
  except BaseException as e:  # pylint: disable=broad-except
    traceback.print_exc()
    if isinstance(e, ValueError):  # as experiments.train ends: the one line, last
      print(f"error: {e}", file=sys.stderr)
    code = 1
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def _spawn(config, workdir: str, log_path: str) -> int:
  pid = os.fork()
  if pid == 0:
    _train(config, workdir, log_path)
  try:
    os.setpgid(pid, pid)  # also here: the kill may come before the child ran a line
  except OSError:
    pass
  return pid


def _entries(ckpt_dir: str, since_ns: int) -> list[tuple[int, str]]:
  """(step, name) of the step directories, committed or temporary, changed since `since_ns`."""
  out = []
  for name in os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []:
    head = name.split(".", 1)[0]
    try:
      if head.isdigit() and os.stat(os.path.join(ckpt_dir, name)).st_mtime_ns >= since_ns:
        out.append((int(head), name))
    except FileNotFoundError:  # renamed or deleted meanwhile
      pass
  return out


def _committed(ckpt_dir: str) -> list[int]:
  if not os.path.isdir(ckpt_dir):
    return []
  return sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit())


def _wait_for_save(pid: int, ckpt_dir: str, step: int, since_ns: int) -> float | None:
  """Until the child begins saving `step` or a later one; returns the seconds from
  `since_ns` to its first save, or None if it exited first."""
  first = None
  while True:
    entries = _entries(ckpt_dir, since_ns)
    if entries and first is None:
      first = (time.time_ns() - since_ns) / 1e9
    if any(s >= step for s, _ in entries):
      return first
    if os.waitpid(pid, os.WNOHANG)[0]:
      return None
    time.sleep(0.005)


def _kill(pid: int) -> None:
  os.killpg(pid, signal.SIGKILL)
  os.waitpid(pid, 0)


NOTHING_SAVED = "nothing saved yet"


def _left(ckpt_dir: str, since_ns: int, problem: str | None, newest: int | None) -> str:
  """What the kill left of the save in flight (the child's own entries only)."""
  mine = _entries(ckpt_dir, since_ns)
  writing = sorted(s for s, name in mine if TMP in name)
  if writing:
    return f"step {writing[-1]} half-written ({TMP})"
  if problem is not None and (newest, str(newest)) in mine:
    return f"step {newest} committed, not verified: {problem}"  # never, with checksums inside
  return "no save in flight" if mine else NOTHING_SAVED


def _lock_pid(workdir: str) -> int | None:
  try:
    with open(os.path.join(workdir, "run.lock"), encoding="utf-8") as f:
      return json.load(f).get("pid")
  except (OSError, ValueError):
    return None


def _read_next_log(crash: Crash, next_run: str, log: str) -> None:
  """What the run after `crash` logged about it: its resume step, warnings, the lock."""
  crash.next_run = next_run
  resumed = re.search(r"resumed from \S+ at step (\d+)", log)
  crash.next_resumed = int(resumed[1]) if resumed else None
  crash.next_warned_unverified = "restoring it unverified" in log
  crash.next_took_lock = (crash.lock_pid is not None
                          and f"taking over a stale lock of pid {crash.lock_pid}" in log)


def _plan(rng: random.Random, number: int, newest: int | None,
          startup_s: float) -> tuple[str, int | None, float]:
  """(label, step whose save starts the clock or None for the fork, delay in seconds)."""
  if number % 4 == 3:
    return "start-up", None, rng.uniform(0, startup_s)
  step = (newest or 0) + rng.randint(1, 3)
  # One in four as the save begins: however fast this machine saves, those land inside one.
  delay = 0.0 if number % 4 == 1 else rng.uniform(0, SAVE_CYCLE_S)
  return f"save of step {step}", step, delay


def _crash_once(config, workdir: str, log_path: str, number: int, rng: random.Random,
                startup: list[float]) -> Crash | None:
  """Starts the run, kills it at a planned point and records what is on disk; None when the
  run finished before the kill point. `startup`: seconds to the first save of the runs
  so far (this one's is appended)."""
  ckpt_dir = os.path.join(workdir, "checkpoints")
  label, step, delay = _plan(rng, number, max(_committed(ckpt_dir), default=None),
                             startup[-1] if startup else 1.0)
  since_ns, start = time.time_ns(), time.monotonic()
  pid = _spawn(config, workdir, log_path)
  if step is not None:
    first_save_s = _wait_for_save(pid, ckpt_dir, step, since_ns)
    if first_save_s is None:
      return None
    startup.append(first_save_s)
  time.sleep(delay)
  if os.waitpid(pid, os.WNOHANG)[0]:
    return None
  _kill(pid)
  killed_after = time.monotonic() - start
  problems = _problems(ckpt_dir)
  newest = max(problems, default=None)
  problem = problems.get(newest)
  older_bad = [f"{s}: {p}" for s, p in problems.items() if s != newest and p is not None]
  return Crash(number, label, killed_after, pid, _left(ckpt_dir, since_ns, problem, newest),
               newest, problem, _lock_pid(workdir), older_bad)


def _problems(ckpt_dir: str) -> dict[int, str | None]:
  """Each committed step's problem: its checksums, then its manifest against the ledger."""
  try:
    entries = ledger.read(ckpt_dir)
  except ledger.CorruptLedger as e:
    return {s: str(e) for s in _committed(ckpt_dir)}
  return {s: ledger.problem(ckpt_dir, s, entries) for s in _committed(ckpt_dir)}


def logged_losses(workdir: str) -> list[tuple[int, float]]:
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def run_to_end(config, workdir: str, log_path: str) -> int:
  pid = _spawn(config, workdir, log_path)
  return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _check_crash(crash: Crash) -> list[str]:
  out = []
  where = f"crash {crash.number} ({crash.plan}, {crash.left})"
  if crash.newest_problem is not None:
    out.append(f"{where}: newest step {crash.newest} does not verify: {crash.newest_problem}")
  # A next run that reached a save has restored (or started afresh) before it; one killed
  # while it had written nothing may not have got that far (a loaded machine's slow start).
  restored = crash.next_resumed is not None or crash.next_run not in ("start-up", NOTHING_SAVED)
  if restored and crash.next_resumed != crash.newest:
    out.append(f"{where}: the next run resumed from step {crash.next_resumed}, "
               f"not the newest committed step {crash.newest}")
  if crash.next_warned_unverified:  # every step this version saves has its checksums
    out.append(f"{where}: the next run restored step {crash.next_resumed} unverified")
  # The lock comes before the restore: a run that resumed has taken it over.
  if crash.next_resumed is not None and crash.lock_pid is not None and not crash.next_took_lock:
    out.append(f"{where}: the next run did not take over run.lock of dead pid {crash.lock_pid}")
  return out


def _check_end(crashed: str, reference: str, total_steps: int, code: int) -> list[str]:
  if code != 0:
    return [f"the last run exited {code} (see {crashed}/logs/final.log)"]
  out = []
  got, want = logged_losses(crashed), dict(logged_losses(reference))
  if [s for s, _ in got] != list(range(1, total_steps + 1)):
    out.append(f"metrics.jsonl has loss rows for steps {[s for s, _ in got]}, "
               f"not each of 1..{total_steps} once")
  differ = [(s, loss, want.get(s)) for s, loss in got if loss != want.get(s)]
  if differ:
    out.append(f"{len(differ)} losses differ from the uninterrupted run's, e.g. "
               f"(step, crashed, reference) {differ[:3]}")
  if os.path.exists(os.path.join(crashed, "run.lock")):
    out.append("run.lock remains after the last run")
  for step, problem in _problems(os.path.join(crashed, "checkpoints")).items():
    if problem is not None:
      out.append(f"step {step} left by the last run does not verify: {problem}")
  return out


def prepare_parent(workdir: str) -> None:
  """Imports what every forked run needs, once, here (XLA_FLAGS and JAX_PLATFORMS already
  set), and makes restarts cheap: jax's compilation cache in `workdir`, no MFU peak."""
  import jax
  from jaxsys import metrics
  from jaxsys.train import loop  # noqa: F401  (imported once, here, for every child)
  try:  # what the run's MetricWriter imports, as it imports it (without torch)
    metrics.summary_writer_class()
  except ImportError:
    pass
  jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  # MFU's peak: two timed 2048^3 matmuls (0.7 s) in every restart, and no checkpoint in them.
  metrics.peak_flops = lambda dtype="float32": metrics.Peak(1e12, "not measured (fault injection)")
  metrics.quiet_library_logs()


def run(workdir: str, crashes: int, seed: int, total_steps: int, source: str) -> dict:
  """The whole experiment (see the module docstring); returns crashes, checks, seconds."""
  config = config_for(source, total_steps)
  reference, crashed = os.path.join(workdir, "reference"), os.path.join(workdir, "crashed")
  logs = os.path.join(crashed, "logs")
  os.makedirs(logs)
  start = time.monotonic()
  ref_code = run_to_end(config, reference, os.path.join(logs, "reference.log"))
  ref_s = time.monotonic() - start
  rng, done, startup = random.Random(seed), [], []
  while len(done) < crashes:
    log = os.path.join(logs, f"run{len(done)}.log")
    crash = _crash_once(config, crashed, log, len(done), rng, startup)
    if done:
      next_run = ("to the end" if crash is None
                  else NOTHING_SAVED if crash.left == NOTHING_SAVED else crash.plan)
      _read_next_log(done[-1], next_run, pathlib.Path(log).read_text())
    if crash is None:  # the run reached total_steps: no kill point left
      break
    done.append(crash)
  final_log = os.path.join(logs, "final.log")
  code = run_to_end(config, crashed, final_log)
  if done and not done[-1].next_run:
    _read_next_log(done[-1], "to the end", pathlib.Path(final_log).read_text())
  problems = [] if ref_code == 0 else [f"the reference run exited {ref_code}"]
  if len(done) < crashes:
    problems.append(f"only {len(done)} of {crashes} kills: the run finished first "
                    "(raise --total_steps)")
  for crash in done:
    problems += _check_crash(crash)
  problems += _check_end(crashed, reference, total_steps, code)
  return {"crashes": [dataclasses.asdict(c) for c in done], "problems": problems,
          "reference_s": ref_s, "seconds": time.monotonic() - start,
          "steps": total_steps, "crashed": crashed, "reference": reference}


def summary(result: dict) -> str:
  """One row per crash, then the counts and the verdict."""
  rows = [f"{'#':>3}  {'kill point':<18} {'at (s)':>6}  {'left on disk':<44} "
          f"{'newest':>6}  next run"]
  for c in result["crashes"]:
    state = "verifies" if c["newest_problem"] is None else "CORRUPT"
    nxt = ("-" if c["next_resumed"] is None else f"resumed {c['next_resumed']}"
           + (", UNVERIFIED" if c["next_warned_unverified"] else ""))
    newest = "-" if c["newest"] is None else f"{c['newest']} {state}"
    rows.append(f"{c['number']:>3}  {c['plan']:<18} {c['killed_after_s']:>6.2f}  "
                f"{c['left']:<44} {newest:>6}  {nxt}")
  crashes = result["crashes"]
  count = lambda text: sum(text in c["left"] for c in crashes)
  resumed = [c for c in crashes if c["next_resumed"] is not None]
  verified = sum(c["newest_problem"] is None for c in resumed)
  rows.append(f"{len(crashes)} kills: {count('half-written')} with a save half-written, "
              f"{count('not verified')} with a committed step that does not verify, "
              f"{count('no save')} between saves, {count('nothing saved')} in the start-up. "
              f"{len(resumed)} next runs resumed, each from the newest committed step "
              f"({verified} verified); {sum(len(c['older_bad']) for c in crashes)} older steps "
              f"left half-deleted by max_to_keep (never restored). {result['seconds']:.1f} s "
              "in all")
  rows += [f"FAIL: {p}" for p in result["problems"]] or [
      f"OK: the losses of steps 1..{result['steps']} equal the uninterrupted run's exactly"]
  return "\n".join(rows)

