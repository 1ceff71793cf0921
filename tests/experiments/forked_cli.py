"""Several command lines of one binary for the price of one start-up.

  python tests/experiments/forked_cli.py CASES.json

CASES.json: {"module": "experiments.train", "cases": [{"argv": [...], "stdout": path,
"stderr": path, "file_limit": bytes or null}, ...]}. One process imports what the binary
imports (jax, orbax, jaxsys: ~2 s of CPU a start), then forks a child per command line,
one after the other; each child runs the binary as `python -m <module> <argv>` would (its
flags parsed there), its stdout and stderr through pipes (as a subprocess's) into their
files, and exits with the binary's status; `file_limit`: its RLIMIT_FSIZE, as on a full
disk (a write past it fails with EFBIG). Prints the statuses as a JSON list.
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
import resource
import runpy
import shutil
import signal
import sys
import threading
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _child(module: str, case, pipes) -> int:
  for fd, (read, write) in zip((1, 2), pipes):  # pipes, as a subprocess's: no file-size limit
    os.dup2(write, fd)
    os.close(write)
    os.close(read)
  if case.get("file_limit") is not None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (case["file_limit"], case["file_limit"]))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write error, not death by signal
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


def _copy(fd: int, path: str) -> None:
  with os.fdopen(fd, "rb") as pipe, open(path, "wb") as out:
    shutil.copyfileobj(pipe, out)


def fork(module: str, case, before=lambda: None) -> tuple[int, list[threading.Thread]]:
  """Forks a child that runs `case` (after `before()`, in the child) and exits with its
  status; (its pid, the threads copying its stdout and stderr into the case's files)."""
  sys.stdout.flush()
  sys.stderr.flush()
  pipes = [os.pipe(), os.pipe()]
  pid = os.fork()
  if pid == 0:
    code = 1
    try:
      before()
      code = _child(module, case, pipes)
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)  # pylint: disable=protected-access
  copies = []
  for (read, write), key in zip(pipes, ("stdout", "stderr")):
    os.close(write)
    copies.append(threading.Thread(target=_copy, args=(read, case[key])))
    copies[-1].start()
  return pid, copies


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
    pid, copies = fork(module, case)
    for copy in copies:
      copy.join()
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
  print(json.dumps(codes))


def run(module: str, argvs, directory, timeout: float = 300, file_limits=None):
  """Runs `python -m module *argv` for each argv in `argvs` from one start-up (above):
  [(exit status, stdout, stderr as the user sees it)], the files in `directory`;
  `file_limits`: each one's RLIMIT_FSIZE in bytes (None: no limit)."""
  import subprocess  # pylint: disable=import-outside-toplevel
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  cases = [{"argv": [str(a) for a in argv], "stdout": str(directory / f"{i}.out"),
            "stderr": str(directory / f"{i}.err"),
            "file_limit": file_limits[i] if file_limits else None}
           for i, argv in enumerate(argvs)]
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
