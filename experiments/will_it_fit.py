r"""Will it fit: a table of real model sizes compiled for TPU slices and GPUs, one command.

  python -m experiments.will_it_fit --out=/tmp/fit              # the docs' table
  python -m experiments.will_it_fit --search --config=llama3:size=8b --topology=v5p-128 \
      --override=model.remat=full --out=/tmp/search             # rank the layouts

The rows and how each is compiled: `jaxsys/bench/will_it_fit.py`. `--search` compiles every
fsdp x tensor x stage mesh (1F1B with vocabulary parallelism) the model can take on the
slice and ranks those that fit by their step's lower bound. Writes `<out>.md` and
`<out>.json`.
"""
import dataclasses
import json

from absl import app, flags

from jaxsys.bench import will_it_fit as fit

_OUT = flags.DEFINE_string("out", "/tmp/jaxsys_will_it_fit", "Writes <out>.md and <out>.json.")
_TIMEOUT = flags.DEFINE_integer("timeout", 900, "Seconds one row may compile.")
_ONLY = flags.DEFINE_string("only", None, "Rows whose label or slice contains this text.")
_SEARCH = flags.DEFINE_bool("search", False, "Rank the layouts of --config on --topology "
                            "instead of the docs' table.")
_CONFIG = flags.DEFINE_string("config", "llama3:size=8b", "With --search: the config.")
_TOPOLOGY = flags.DEFINE_string("topology", "v5p-128", "With --search: the slice.")
_EXTRA = flags.DEFINE_multi_string("override", [], "With --search: a --config.* override "
                                   "every layout gets (e.g. model.remat=full).")


def main(argv):
  del argv
  if _SEARCH.value:
    size = _CONFIG.value.partition("size=")[2] or "8b"
    rows = fit.search_rows(size, _TOPOLOGY.value, tuple(_EXTRA.value))
  else:
    rows = [r for r in fit.ROWS if not _ONLY.value or _ONLY.value in f"{r.label} {r.topology}"]
  reports = []
  for row in rows:
    reports.append(fit.compile_row(row, _TIMEOUT.value))
    print(" | ".join(fit.cells(row, reports[-1])), flush=True)
  if _SEARCH.value:
    rows, reports = fit.ranked(rows, reports)
  table = fit.markdown(rows, reports)
  with open(_OUT.value + ".md", "w", encoding="utf-8") as f:
    f.write(table + "\n")
  with open(_OUT.value + ".json", "w", encoding="utf-8") as f:
    json.dump([dataclasses.asdict(r) | {"report": rep} for r, rep in zip(rows, reports)], f,
              indent=1)
  print(table)


if __name__ == "__main__":
  app.run(main)
