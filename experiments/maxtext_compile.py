r"""MaxText's train step for the same work, compiled for a TPU slice on this host and counted
with jaxsys's counters: the side-by-side of `python -m experiments.compile`.

MaxText 0.2.5 needs Python >= 3.12 and jax >= 0.11.1, so it lives in a venv of its own
(jax 0.12.0.1, libtpu 0.0.50.1; not this repository's environment):

  /root/.pyenv/versions/3.12.1/bin/python -m venv /tmp/mt312
  /tmp/mt312/bin/pip install 'maxtext[tpu]==0.2.5'
  /tmp/mt312/bin/pip install 'jax[tpu]==0.12.0.1' 'libtpu==0.0.50.1'  # maxtext pulls 0.0.52

Then, from the repository root (jaxsys is imported from the checkout, not installed):

  /tmp/mt312/bin/python experiments/maxtext_compile.py --case=v5p128_full \
      --json=/tmp/maxtext_side_by_side/mt_v5p128_full.json
  /tmp/mt312/bin/python experiments/maxtext_compile.py --case=v5p128_minimal \
      --json=/tmp/maxtext_side_by_side/mt_v5p128_minimal.json
  /tmp/mt312/bin/python experiments/maxtext_compile.py --case=v6e256_recipe \
      --json=/tmp/maxtext_side_by_side/mt_v6e256_recipe.json

and jaxsys's own program for the first case, in this repository's environment:

  python -m experiments.compile --config=configs/llama3.py:size=8b --topology=v5p-128 \
      --config.mesh=fsdp=64 --config.model.remat=full --json=/tmp/jx_8b_full.json

It prints the train step's memory, FLOPs, collective bytes and compile time per device
(every figure in --json). The cases and how the program is measured:
`jaxsys/bench/maxtext_compile.py`. Without maxtext 0.2.5 this prints one line and exits 1.
"""
import json
import os
import sys

from absl import app, flags

# jaxsys is read from this checkout: the MaxText venv does not install it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxsys.bench import maxtext_compile

FLAGS = flags.FLAGS


def _define_flags() -> None:
  """The binary's flags, defined only when it runs: importing it defines none, so they
  cannot clash with another experiment's (`--json`) in the same process."""
  flags.DEFINE_enum("case", "v5p128_full", list(maxtext_compile.CASES), "The program to compile.")
  flags.DEFINE_string("json", None, "Write the figures to this JSON file.")
  flags.DEFINE_string("hlo", None, "Also write the compiled HLO text to this file.")
  flags.DEFINE_multi_string("set", [], "A MaxText config override, key=value (after the "
                            "case's), e.g. gradient_accumulation_steps=4.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  version = maxtext_compile.installed_version()
  if version != maxtext_compile.MAXTEXT_VERSION:
    found = "is not installed" if version is None else f"is not installed ({version} is)"
    print(f"maxtext {maxtext_compile.MAXTEXT_VERSION} {found} in this python: "
          f"{maxtext_compile.INSTALL}")
    return 1
  try:
    maxtext_compile.maxtext_argv(FLAGS.case, FLAGS.set, base="")
  except ValueError as e:
    print(f"error: {e}")
    return 1
  out = maxtext_compile.compile_case(FLAGS.case, FLAGS.set, FLAGS.hlo)
  print(maxtext_compile.summary(out))
  if FLAGS.json:
    with open(FLAGS.json, "w", encoding="utf-8") as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  _define_flags()
  app.run(main)  # exits with main's return value
