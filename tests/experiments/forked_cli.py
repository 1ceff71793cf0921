"""Several command lines of one binary for the price of one start-up.

  python tests/experiments/forked_cli.py CASES.json

CASES.json: {"module": "experiments.train", "cases": [{"argv": [...], "stdout": path,
"stderr": path}, ...]}. One process imports what the binary imports (jax, orbax, jaxsys:
~2 s of CPU a start), then forks a child per command line; each child runs the binary as
`python -m <module> <argv>` would (its flags parsed there), its stdout and stderr into its
own files, and exits with the binary's status. Prints the statuses as a JSON list.
experiments.train runs its main from jaxsys.cli.train (imported here); another binary runs
as __main__, after this process imported the modules its source imports at the top (not
the binary's own module, whose flags each child defines). Left out: the train binary's
re-exec with huge-page malloc (jaxsys.hugepages); what the imports printed is this
process's stderr (the tests put it before each child's).
"""
import ast
import importlib
import json
import os
import pathlib
import runpy
import sys
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _child(module: str, case) -> int:
  for fd, key in ((1, "stdout"), (2, "stderr")):
    out = os.open(case[key], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, fd)
    os.close(out)
  sys.argv = [str(ROOT.joinpath(*module.split(".")).with_suffix(".py")), *case["argv"]]
  try:
    if module == "experiments.train":
      from jaxsys.cli import train  # pylint: disable=import-outside-toplevel
      train.run()
    else:
      runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0
  except SystemExit as e:  # as the interpreter exits on it
    if e.code is None or isinstance(e.code, int):
      return e.code or 0
    print(e.code, file=sys.stderr)
    return 1
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    return 1


def _import_what_it_imports(module: str) -> None:
  """The modules `module`'s source imports at its top level (`from a import b`: a.b where
  that is a module, else a)."""
  path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, ast.Import):
      for alias in node.names:
        importlib.import_module(alias.name)
    elif isinstance(node, ast.ImportFrom) and not node.level:
      importlib.import_module(node.module)
      for alias in node.names:
        try:
          importlib.import_module(f"{node.module}.{alias.name}")
        except ImportError:  # a name, not a module
          pass


def main(path: str) -> None:
  spec = json.loads(pathlib.Path(path).read_text())
  module = spec["module"]
  if module == "experiments.train":
    importlib.import_module("jaxsys.cli.train")
  else:
    _import_what_it_imports(module)
  codes = []
  for case in spec["cases"]:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      code = 1
      try:
        code = _child(module, case)
      finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # pylint: disable=protected-access
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
  print(json.dumps(codes))


def run(module: str, argvs, directory, timeout: float = 300):
  """Runs `python -m module *argv` for each argv in `argvs` from one start-up (above):
  [(exit status, stdout, stderr as the user sees it)], the files in `directory`."""
  import subprocess  # pylint: disable=import-outside-toplevel
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  cases = [{"argv": [str(a) for a in argv], "stdout": str(directory / f"{i}.out"),
            "stderr": str(directory / f"{i}.err")} for i, argv in enumerate(argvs)]
  (directory / "cases.json").write_text(json.dumps(
      {"module": module, "cases": cases}))
  proc = subprocess.run([sys.executable, __file__, str(directory / "cases.json")], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-3000:]
  codes = json.loads(proc.stdout.splitlines()[-1])
  return [(code, pathlib.Path(c["stdout"]).read_text(),
           proc.stderr + pathlib.Path(c["stderr"]).read_text()) for code, c in zip(codes, cases)]


if __name__ == "__main__":
  main(sys.argv[1])
