"""Several command lines of `python -m experiments.train` for the price of one start-up.

  python tests/experiments/forked_cli.py CASES.json

One process imports the binary (jax, orbax, jaxsys: ~2 s of CPU a start), then forks a
child per command line in CASES.json (a list of {"argv": [...], "stdout": path, "stderr":
path}); each child parses its flags and runs the binary's main as `python -m
experiments.train` would, its stdout and stderr into its own files, and exits with the
binary's status. Prints the statuses as a JSON list. The binary's own re-exec with
huge-page malloc (jaxsys.hugepages) is left out; what the import printed is this
process's stderr (tests/experiments/test_train_cli.py puts it before each child's).
"""
import json
import os
import pathlib
import sys
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from jaxsys.cli import train  # pylint: disable=wrong-import-position


def _child(case) -> int:
  for fd, key in ((1, "stdout"), (2, "stderr")):
    out = os.open(case[key], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, fd)
    os.close(out)
  sys.argv = [str(ROOT / "experiments" / "train.py"), *case["argv"]]
  try:
    train.run()
    return 0
  except SystemExit as e:  # as the interpreter exits on it
    if e.code is None or isinstance(e.code, int):
      return e.code or 0
    print(e.code, file=sys.stderr)
    return 1
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    return 1


def main(path: str) -> None:
  codes = []
  for case in json.loads(pathlib.Path(path).read_text()):
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      code = 1
      try:
        code = _child(case)
      finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # pylint: disable=protected-access
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
  print(json.dumps(codes))


if __name__ == "__main__":
  main(sys.argv[1])
