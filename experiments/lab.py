r"""The network lab: a training run across P processes joined by a shaped link.

  python -m experiments.lab --processes=2 --bandwidth=100mbit -- \
      --config=configs/tiny_lm.py:size=test --config.mesh=data=2 --workdir=/tmp/lab_dp

Creates a network namespace, shapes its loopback to --bandwidth (`tc` token bucket: one
link that all of the run's traffic shares; `none`: unshaped; or --topology=switched: a
namespace per process, each with a link of --bandwidth each way to a switch), starts
--processes copies of the runner (`python -m jaxsys.cli.train` with the flags after `--`)
in it, joined by
`jax.distributed` and each pinned to a core of its own where there are enough, and removes
the namespace and every process when the run ends, fails, or is stopped (Ctrl-C, SIGTERM).
The runner's mesh spans all processes' devices (`--config.mesh=data=2` over two processes
of one device; `replica=2` puts one replica in each).

Process 0's progress is shown as the runner's; every process's log, and per step the wall
time, the time the link was busy and the bytes it carried, are in <workdir>/lab. The last
line on stdout is one JSON summary: step_time_s (median over the steps after the first),
wire_bytes_per_step, tokens_per_s, bandwidth_bps, comm_s, collective_bytes_per_step (the
compiled train step's, when each process has one device). Needs root and iproute2 (`ip`,
`tc`) for a shaped link; exit 1 with one `error:` line on bad input or a failed process.
"""
import json
import signal
import sys

from absl import app, flags

from jaxsys.lab import link, run

flags.DEFINE_integer("processes", 2, "Processes P, joined by jax.distributed (>= 2).")
flags.DEFINE_string("bandwidth", "100mbit", "The link's rate: a number with bit, kbit, mbit "
                    "or gbit (bits per second), or none (unshaped).")
flags.DEFINE_enum("topology", "shared", ["shared", "switched"], "shared: one link all the "
                  "processes' traffic crosses; switched: each process its own namespace and a "
                  "link of --bandwidth each way to a switch.")
flags.DEFINE_integer("devices_per_process", 1, "CPU devices in each process.")
flags.DEFINE_string("runner", run.RUNNER, "The module each process runs (python -m).")
flags.DEFINE_float("timeout", None, "Seconds before the run is stopped as failed.")
FLAGS = flags.FLAGS


def _interrupt(signum, frame):
  del frame
  raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv):
  signal.signal(signal.SIGTERM, _interrupt)  # cleaned up like Ctrl-C
  cfg = run.LabConfig(processes=FLAGS.processes, bandwidth=FLAGS.bandwidth,
                      runner_args=tuple(argv[1:]), devices_per_process=FLAGS.devices_per_process,
                      runner=FLAGS.runner, timeout_s=FLAGS.timeout, topology=FLAGS.topology)
  try:
    summary = run.run_lab(cfg)
  except link.LabError as e:
    sys.exit(f"error: {e}")
  except KeyboardInterrupt as e:
    sys.exit(f"error: stopped by {e or 'SIGINT'}; the namespace and every process are removed")
  print(json.dumps(summary), flush=True)


if __name__ == "__main__":
  app.run(main)
