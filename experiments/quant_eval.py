r"""Post-training quantization of a trained run: one accuracy table, beside qwix's PTQ.

  python -m experiments.quant_eval --workdir=/tmp/jaxsys_tiny
  python -m experiments.quant_eval --workdir=/tmp/q --init_from=hf:/ckpt/SmolLM-135M \
      --config=tiny_lm --config.data.seq_len=512

Loads the latest checkpoint of --workdir (its config comes from the checkpoint's meta),
or with --init_from=hf:<dir> a Hugging Face Llama checkpoint (the model and tokenizer are
its own, the data, eval and batch settings --config's; --workdir receives the table),
quantizes the layer matmuls with every scheme x method (RTN; SmoothQuant for
w8a8_int8; GPTQ with calibration batches of the TRAIN split) and with qwix, scores
validation bits per byte on the run's own eval batches, prints the table and writes
quant_eval.json and quant_eval.md into --workdir.
"""
import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from jaxsys import configs
from jaxsys import metrics as metrics_lib
from jaxsys.cli import hf_runs
from jaxsys.cli import args
from jaxsys.cli import quant_runs
from jaxsys import fields

_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir of a training run (experiments.train).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_CALIB = flags.DEFINE_integer("calib_batches", 8, "Training batches for GPTQ / SmoothQuant.")
_EVAL_STEPS = flags.DEFINE_integer("eval_steps", None, "Val batches every row is scored on "
                                   "(default: the run's eval_steps); the same for every row.")
_GROUP = flags.DEFINE_integer("group_size", 128, "w4a16 group size (rows of K per scale).")
_ALPHA = flags.DEFINE_float("alpha", 0.5, "SmoothQuant migration strength.")
_ROWS = flags.DEFINE_string("rows", None, "Rows after the float one, e.g. "
                            "'w4a16:gptq,w4a16:gptq+act_order,w8a8_int8:qwix' (default: all).")
_INIT_FROM = flags.DEFINE_string("init_from", None, "'hf:<dir>': quantize that Hugging Face "
                                 "Llama checkpoint instead of --workdir's.")
_CONFIG = config_flags.DEFINE_config_file(
    "config", configs.path("tiny_lm"), "With --init_from: the data, eval and calibration "
    "settings (a config file's path or a packaged config's name).", lock_config=True)
flags.mark_flags_as_required(["workdir"])
# Valid values of the numeric flags, checked before the checkpoint is loaded.
_FLAG_RULES = ((_STEP, fields.integer(0)), (_CALIB, fields.integer(1)),
               (_EVAL_STEPS, fields.integer(2)),
               (_GROUP, fields.integer(1)), (_ALPHA, fields.number(0, 1)))


def main(argv):
  del argv
  metrics_lib.quiet_library_logs()
  try:
    for flag, rule in _FLAG_RULES:
      error = flag.value is not None and rule.error(f"--{flag.name}", flag.value)
      if error:
        raise ValueError(error)
    wanted = quant_runs.DEFAULT_ROWS if _ROWS.value is None else quant_runs.parse_rows(_ROWS.value)
    if _INIT_FROM.value is None:
      run = quant_runs.load_run(_WORKDIR.value, _STEP.value)
    else:
      run = hf_runs.ptq_run(_CONFIG.value, _INIT_FROM.value)
      os.makedirs(_WORKDIR.value, exist_ok=True)
  except ValueError as e:
    sys.exit(f"error: {e}")
  rows = quant_runs.evaluate_table(run, _WORKDIR.value, rows=wanted, calib_batches=_CALIB.value,
                                 group_size=_GROUP.value, alpha=_ALPHA.value,
                                 eval_steps=_EVAL_STEPS.value)
  table = quant_runs.markdown(rows)
  batches = len(rows[0]["batch_loss_sums"])
  header = (f"{_WORKDIR.value} step {run.step}: val bits/byte over {batches} batches "
            f"({batches * run.config.data.batch_size * run.config.data.seq_len:,} token "
            "positions), each row against the float model by a paired bootstrap over those "
            f"batches; calibration {_CALIB.value} train batches; w4a16 group {_GROUP.value}")
  print(header + "\n\n" + table)
  with open(os.path.join(_WORKDIR.value, "quant_eval.json"), "w") as f:
    json.dump({"step": run.step, "eval_steps": batches,
               "calib_batches": _CALIB.value, "group_size": _GROUP.value, "alpha": _ALPHA.value,
               "rows": rows}, f, indent=1)
  with open(os.path.join(_WORKDIR.value, "quant_eval.md"), "w") as f:
    f.write(header + "\n\n" + table + "\n")


if __name__ == "__main__":
  app.run(main, flags_parser=args.parse_flags)
