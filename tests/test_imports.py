"""The import graph among jaxsys modules, function-local imports included: no cycle, and no
import up the layers of docs/design.md; and no function longer than a newcomer reads whole."""
import ast
import pathlib

from absl.testing import absltest

import jaxsys

_ROOT = pathlib.Path(jaxsys.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
  """Dotted name -> file of every module in the package (a package is its __init__)."""
  out = {}
  for path in _ROOT.rglob("*.py"):
    parts = path.relative_to(_ROOT.parent).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


def import_graph() -> dict[str, set[str]]:
  """Module -> the jaxsys modules it imports anywhere in its body."""
  modules = _modules()
  graph = {}
  for name, path in modules.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    deps = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: resolve against the importing package
          anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
          base = ".".join(anchor + ([base] if base else []))
        # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod.
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                   for a in node.names]
      else:
        continue
      deps.update(t for t in targets if t in modules and t != name)
    graph[name] = deps
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle as [a, b, ..., a], or None; depth-first search with colours."""
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for dep in sorted(graph[node]):
      if state.get(dep) == "open":
        return stack[stack.index(dep):] + [dep]
      if dep not in state and (cycle := visit(dep)):
        return cycle
    stack.pop()
    state[node] = "done"
    return None

  for node in sorted(graph):
    if node not in state and (cycle := visit(node)):
      return cycle
  return None


# jaxsys's packages and top-level modules, lowest first (docs/design.md, "Layers"). A module
# imports from its own layer or the ones below; within a layer, the acyclicity test orders.
LAYERS = (
    ("platforms", "xla_flags", "hugepages", "storage", "stats", "chips", "flops", "hlo_flops",
     "comm_bytes", "preemption", "metrics", "mesh", "fields"),
    ("kernels",),
    ("models",),
    ("data", "optim", "parallel", "quant", "checkpoint"),
    ("config",),
    ("train",),
    ("cli", "bench", "device_report", "lab", "configs", "notebook"),
)


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
  """Every `a -> b` where b's layer is above a's ('jaxsys.x.y' is in x's layer)."""
  level = {name: i for i, names in enumerate(layers) for name in names}
  of = lambda module: level[module.split(".")[1]] if "." in module else -1
  return sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps if of(b) > of(a))


MAX_FUNCTION_LINES = 150  # a function a newcomer can read whole


def long_functions(source: str, name: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
  """'name:function (n lines)' for each function of `source` longer than `limit` lines."""
  return [f"{name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
          for node in ast.walk(ast.parse(source))
          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
          and node.end_lineno - node.lineno + 1 > limit]


class ImportGraphTest(absltest.TestCase):

  def test_finds_a_planted_long_function(self):
    body = "def f():\n" + "  x = 1\n" * 150
    self.assertEqual(long_functions(body, "m"), ["m:f (151 lines)"])
    self.assertEqual(long_functions(body, "m", limit=151), [])

  def test_no_function_is_longer_than_150_lines(self):
    found = [f for name, path in _modules().items()
             for f in long_functions(path.read_text(), name)]
    self.assertEqual(found, [])

  def test_finds_a_planted_cycle(self):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    self.assertEqual(find_cycle(graph), ["a", "b", "c", "a"])
    self.assertIsNone(find_cycle({"a": {"b"}, "b": set()}))

  def test_sees_function_local_imports(self):
    graph = import_graph()
    self.assertIn("jaxsys.kernels.attention", graph["jaxsys.models.transformer"])
    self.assertIn("jaxsys.kernels.quant_matmul", graph["jaxsys.models.transformer"])

  def test_finds_a_planted_upward_import(self):
    graph = {"jaxsys.models.m": {"jaxsys.mesh", "jaxsys.train.t"}, "jaxsys.train.t": set(),
             "jaxsys.mesh": set()}
    self.assertEqual(upward_imports(graph), ["jaxsys.models.m -> jaxsys.train.t"])

  def test_every_module_has_a_layer(self):
    named = {name for names in LAYERS for name in names}
    self.assertEqual({m.split(".")[1] for m in import_graph() if "." in m} - named, set())

  def test_no_import_runs_up_the_layers(self):
    self.assertEqual(upward_imports(import_graph()), [])

  def test_package_is_acyclic(self):
    cycle = find_cycle(import_graph())
    self.assertIsNone(cycle, f"import cycle: {' -> '.join(cycle or [])}")


if __name__ == "__main__":
  absltest.main()
