r"""Trains a language model from an ml_collections config.

  jaxsys-train --config=tiny_lm --workdir=/tmp/jaxsys_tiny      # from any directory
  python -m experiments.train --config=configs/tiny_lm.py --workdir=/tmp/jaxsys_tiny
  python -m experiments.train --config=configs/tiny_lm.py:size=small --config.total_steps=30 \
      --config.mesh=fsdp=-1 --workdir=/tmp/jaxsys_small

`--config` is a config file's path or the name of one shipped in `jaxsys/configs` (the
repository's `configs/`): `tiny_lm`, `tiny_lm:size=small`, `compare_outer`.

Re-running with the same --workdir resumes from its latest checkpoint. On Linux the binary
re-executes itself once with huge-page malloc (`jaxsys.hugepages`; JAXSYS_HUGE_PAGES=0 opts
out): faster CPU steps, and asynchronous checkpoint saves that do not stall the loop.

Exit status: 0 when the run reached total_steps (it prints "done at step N"); 75
(EX_TEMPFAIL) when SIGTERM stopped it early, after saving a checkpoint (it prints
"preempted at step N"), or, at any moment before the first step (imports, flags,
compilation, the restore), at once, with nothing changed ("preempted before the first
step", `jaxsys.preemption`): run the same command again to resume. With several processes,
all of them stop at the same step and exit 75. Bad input exits 1 with one "error:" line;
so does a write that fails (a full disk), naming what failed and the checkpoints left.
Several processes (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, or a
cluster jax detects by itself) join one run through jax.distributed.
"""
import os
import sys
import warnings

if __name__ == "__main__":  # python -m jaxsys.cli.train (the network lab's runner)
  from jaxsys.cli import start
  start.before_jax()

import jax  # pylint: disable=wrong-import-position
from absl import app, flags, logging
from ml_collections import config_flags

from jaxsys import metrics as metrics_lib
from jaxsys import preemption
from jaxsys import storage
from jaxsys.cli import args
from jaxsys.train import config_check
from jaxsys.train import loop

_CONFIG = config_flags.DEFINE_config_file("config", None, "A config file's path or a packaged "
                                          "config's name (:arg optional).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")
flags.mark_flags_as_required(["config", "workdir"])

EXIT_PREEMPTED = preemption.EXIT_CODE  # EX_TEMPFAIL: stopped early by SIGTERM, run again

_MULTI_PROCESS_ENV = ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
                      "TPU_WORKER_HOSTNAMES")


def maybe_initialize_distributed() -> None:
  """Joins a multi-process run when the environment announces one."""
  if not any(os.environ.get(k) for k in _MULTI_PROCESS_ENV):
    return
  kwargs = {}
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    kwargs = dict(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                  num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                  process_id=int(os.environ["JAX_PROCESS_ID"]))
  jax.distributed.initialize(**kwargs)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  metrics_lib.quiet_library_logs()
  maybe_initialize_distributed()
  config = _CONFIG.value
  try:  # before anything is logged or built, so a bad value is the only line
    run = config_check.check_config(config, _WORKDIR.value)
  except ValueError as e:
    sys.exit(f"error: {e}")
  logging.info("jax %s, backend %s, %d devices (%d local), process %d of %d", jax.__version__,
               jax.default_backend(), jax.device_count(), jax.local_device_count(),
               jax.process_index(), jax.process_count())
  logging.info("config:\n%s", config)
  # A save that fails leaves orbax's write coroutines unawaited; Python would report each at
  # exit, after the one error line.
  warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
  try:
    result = loop.train(run, _WORKDIR.value)
  except (ValueError, storage.WriteError) as e:  # bad input, a full disk: one line, no traceback
    logging.error("%s", e)
    sys.exit(f"error: {e}")
  except OSError as e:
    if e.errno in storage.NO_SPACE:
      error = storage.WriteError(f"writing in --workdir {_WORKDIR.value}", e,
                                 after=f"file {e.filename}" if e.filename else "")
    elif e.filename:  # a file of the workdir that is not what a run makes (a directory, chmod 000)
      error = (f"cannot use {e.filename}: {e.strerror} (errno {e.errno}); the files of "
               f"--workdir {_WORKDIR.value} must be regular files and directories this user can "
               "read and write")
    else:
      raise
    logging.error("%s", error)
    sys.exit(f"error: {error}")
  if jax.process_index() == 0:
    if result["preempted"]:
      print(f"preempted at step {result['step']} by SIGTERM: saved; run the same command again "
            "to resume")
    else:
      print(f"done at step {result['step']}" +
            (f", val_bpb={result['val_bpb']:.4f}" if "val_bpb" in result else ""))
    print(f"metrics:     {result['metrics']}")
    if result.get("tensorboard"):
      print(f"tensorboard: {result['tensorboard']}")
    print(f"checkpoints: {result['checkpoints']}")
    if result.get("profile"):
      print(f"profile:     {result['profile']}")
  return EXIT_PREEMPTED if result["preempted"] else 0


def run() -> None:
  """The binary: absl's flags (config overrides included), then `main`. SIGTERM before the
  first step exits 75 with one line (`jaxsys.preemption`; `scripts.train` installs that
  before jax is imported)."""
  with preemption.exits_preempted():
    preemption.install()
    jax.config.config_with_absl()
    app.run(main, flags_parser=args.parse_flags)


if __name__ == "__main__":
  run()
