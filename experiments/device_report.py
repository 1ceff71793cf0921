r"""The device report: jaxsys measured on one GPU in under eight minutes.

  python3 -m experiments.device_report --out=/tmp/report          # on a GPU
  python -m experiments.device_report --smoke --out=/tmp/report   # CPU: tiny sizes

Checks the Pallas kernels against the reference on the device, then times attention
(beside cuDNN and XLA), the quantized matmuls (beside a bf16 dot), the runner's train step
for the GPT-2-sized and Llama-3-1B presets (tokens/s, MFU, memory) and KV-cache decoding,
each part within its share of `--budget_s` (a part the remaining budget cannot hold is
skipped with a note). Writes `device_report.md` and `device_report.json` into --out and
prints the markdown. `tools/device_prepare.sh` prepares a GPU machine with no package
registry and prints the command that runs this there; docs/results/gpu.md holds the results.

Exit status: 0 when every part that ran passed; 1 when a check failed or a part raised
(the other parts still run), and for bad input (one `error:` line).
"""
import sys

from jaxsys.device_report import preflight

if __name__ == "__main__":  # before jax: a missing package is one line, not a traceback
  _MISSING = preflight.missing()
  if _MISSING:
    sys.exit(f"error: package {_MISSING[0]} is not installed (missing: {', '.join(_MISSING)});"
             " on a machine with no registry, run tools/device_prepare.sh where there is one"
             " and install the wheels it downloads")

import jax  # pylint: disable=wrong-import-position
from absl import app, flags  # pylint: disable=wrong-import-position

from jaxsys import metrics  # pylint: disable=wrong-import-position
from jaxsys.device_report import report, sizes  # pylint: disable=wrong-import-position

_OUT = flags.DEFINE_string("out", None, "Directory for device_report.md and device_report.json.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Every part at tiny sizes, on CPU too (a test).")
_BUDGET = flags.DEFINE_float("budget_s", None, "Seconds for the whole report (default: "
                             f"{sizes.FULL.budget_s:g} on a GPU, {sizes.SMOKE.budget_s:g} "
                             "with --smoke).")
_PARTS = flags.DEFINE_list("parts", list(report.NAMES), "Parts to run, in the report's order.")


def _check_flags() -> None:
  if not _OUT.value:
    raise ValueError("--out is required: the directory the report is written into")
  unknown = [p for p in _PARTS.value if p not in report.NAMES]
  if unknown:
    raise ValueError(f"--parts: {unknown[0]!r} is not a part; choose from "
                     f"{', '.join(report.NAMES)}")
  if _BUDGET.value is not None and not _BUDGET.value > 0:
    raise ValueError(f"--budget_s={_BUDGET.value:g} must be > 0 seconds")
  if not _SMOKE.value and jax.default_backend() != "gpu":
    raise ValueError(f"no GPU found (jax's backend is {jax.default_backend()!r}): run this on "
                     "a GPU machine, or pass --smoke for the CPU mode")


def main(argv):
  if len(argv) > 1:
    sys.exit(f"error: unexpected arguments {argv[1:]}")
  metrics.quiet_library_logs()
  try:
    _check_flags()
  except ValueError as e:
    sys.exit(f"error: {e}")
  result = report.run_report(sizes.SMOKE if _SMOKE.value else sizes.FULL,
                             report.select(_PARTS.value), _BUDGET.value,
                             command=" ".join(["python3 -m experiments.device_report",
                                               *sys.argv[1:]]))
  paths = report.write(result, _OUT.value)
  print(report.markdown(result))
  print("wrote " + ", ".join(paths))
  sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
  app.run(main)
