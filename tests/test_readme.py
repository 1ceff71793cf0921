"""The commands and links the README shows work as shown.

Every `python -m experiments.<name> ...` and console-script (`jaxsys-train ...`) command in a
fenced code block of the README (and of
`docs/results/*.md`, where the README's results moved) is parsed as the binary would parse
it: the module exists, every flag is one it defines (read from its source with `ast`, so no
binary is imported here: absl flags are process-global), `--config=<file>[:arg]` loads and
each `--config.a.b=value` names a field of that config with a value of its type (the
`ml_collections` parser itself, on a private `FlagValues`). Every `--config.a.b=value` in
the README's inline code is checked against `configs/tiny_lm.py`, and every relative link
in these pages must resolve.
"""
import ast
import functools
import pathlib
import re
import shlex
import sys
import tomllib
import types

import pytest
from absl import flags
from ml_collections import config_flags

from jaxsys import configs

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs" / "results").glob("*.md"))]
LINKED = [*PAGES, ROOT / "docs" / "design.md"]

# config_flags loads config files with the deprecated SourceFileLoader.load_module.
pytestmark = pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")

# Binaries that start another with the flags after `--`: the network lab runs the trainer.
LAUNCHERS = {"experiments.lab": "jaxsys.cli.train"}
# Console scripts -> the binary module each runs (`jaxsys.cli.scripts:train` runs
# `jaxsys.cli.train`).
SCRIPTS = {name: "jaxsys.cli." + target.rpartition(":")[2] for name, target in
           tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"].items()}

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_SEPARATORS = {"&&", "||", ";", "|", "&"}


def _commands(text: str) -> list[tuple[int, list[str]]]:
  """(line, argv with the module first) of each `python -m experiments.<name>` command in the
  fenced code blocks; a command may continue over lines ending in a backslash."""
  out = []
  for block in _FENCE.finditer(text):
    line = text.count("\n", 0, block.start(1)) + 1
    for logical in re.split(r"(?<!\\)\n", block.group(1)):
      words = shlex.split(logical.replace("\\\n", " "), comments=True)
      for i, word in enumerate(words):
        if re.fullmatch(r"python3?", word) and words[i + 1:i + 2] == ["-m"] \
            and words[i + 2:i + 3] and words[i + 2].startswith("experiments."):
          module, args = words[i + 2], words[i + 3:]
        elif word in SCRIPTS:
          module, args = SCRIPTS[word], words[i + 1:]
        else:
          continue
        end = next((j for j, w in enumerate(args) if w in _SEPARATORS), len(args))
        args = args[:end]
        if module in LAUNCHERS and "--" in args:  # the flags after `--` are its runner's
          split = args.index("--")
          out.append((line, [LAUNCHERS[module], *args[split + 1:]]))
          args = args[:split]
        out.append((line, [module, *args]))
      line += logical.count("\n") + 1
  return out


def _cases():
  return [pytest.param(argv, id=f"{page.relative_to(ROOT)}:{line}:{argv[0]}")
          for page in PAGES for line, argv in _commands(page.read_text())]


def _literal(node, constants):
  try:
    return ast.literal_eval(node)
  except ValueError:
    return constants.get(node.id) if isinstance(node, ast.Name) else None


@functools.lru_cache(maxsize=None)
def _defined_flags(module: str) -> dict[str, tuple]:
  """name -> (DEFINE_ function, default, enum values) of every flag the module's source
  defines, at module level or in a function it calls when run (`_define_flags`)."""
  tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
  binary = [n.module for n in tree.body if isinstance(n, ast.ImportFrom)
            and (n.module or "").startswith("jaxsys.cli.")]
  if any(isinstance(n, ast.ImportFrom) and n.module == "jaxsys.cli"
         and [a.name for a in n.names] == ["scripts"] for n in tree.body):
    # scripts.<name>() runs jaxsys.cli.<name>
    called = [n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call)
              and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
              and n.func.value.id == "scripts"]
    binary = [f"jaxsys.cli.{called[0]}"]
  if binary:  # a wrapper of a packaged binary: that binary's flags
    return _defined_flags(binary[0])
  constants = {}
  for node in tree.body:
    if isinstance(node, ast.Assign) and len(node.targets) == 1 \
        and isinstance(node.targets[0], ast.Name):
      try:
        constants[node.targets[0].id] = ast.literal_eval(node.value)
      except ValueError:
        pass
  out = {}
  for node in ast.walk(tree):
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr.startswith("DEFINE_")):
      continue
    args = list(node.args) + [None] * 3
    kw = {k.arg: k.value for k in node.keywords}
    name = kw.get("name", args[0])
    if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
      continue
    default = kw.get("default", args[1])
    enum = kw.get("enum_values", args[2]) if node.func.attr == "DEFINE_enum" else None
    out[name.value] = (node.func.attr, None if default is None else _literal(default, constants),
                       None if enum is None else _literal(enum, constants))
  return out


def _flag_values(module: str, argv: list[str]) -> flags.FlagValues:
  """A private FlagValues with the module's flags, typed as the module defines them."""
  fv = flags.FlagValues()
  for name, (kind, default, enum) in _defined_flags(module).items():
    if kind == "DEFINE_config_file":
      config_flags.DEFINE_config_file(name, default, flag_values=fv, sys_argv=argv)
    elif kind in ("DEFINE_bool", "DEFINE_boolean"):
      flags.DEFINE_bool(name, None, "", flag_values=fv)
    elif kind in ("DEFINE_integer", "DEFINE_float", "DEFINE_list"):
      getattr(flags, kind)(name, None, "", flag_values=fv)
    elif kind == "DEFINE_enum" and enum:
      flags.DEFINE_enum(name, None, list(enum), "", flag_values=fv)
    else:
      flags.DEFINE_string(name, None, "", flag_values=fv)
  return fv


class BadCommand(Exception):
  """A command its binary would refuse at flag parsing."""


def _parse(module: str, args: list[str], monkeypatch) -> flags.FlagValues:
  """Parses `args` as `python -m <module>` would (configs load relative to the root)."""
  assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), f"no {module} in experiments/"
  monkeypatch.chdir(ROOT)
  # config_flags loads a config file as the module `config`: a fresh one, removed after
  monkeypatch.setitem(sys.modules, "config", types.ModuleType("config"))
  # A packaged config's name, as the binary resolves it (`jaxsys.configs`).
  args = [f"--config={configs.path(a[9:].partition(':')[0])}:{a.partition(':')[2]}".rstrip(":")
          if a.startswith("--config=") and configs.path(a[9:].partition(":")[0])
          and not (ROOT / a[9:].partition(":")[0]).is_file() else a for a in args]
  argv = [module, *args]
  fv = _flag_values(module, argv)
  try:  # a bad flag is a flags.Error; a bad config field or argument whatever loading raised
    rest = fv(argv)
  except Exception as e:  # pylint: disable=broad-except
    raise BadCommand(f"{type(e).__name__}: {e}") from e
  if rest != [module]:
    raise BadCommand(f"arguments that are no flag: {rest[1:]}")
  return fv


@pytest.mark.parametrize("argv", _cases())
def test_command_parses(argv, monkeypatch):
  module, *args = argv
  try:
    _parse(module, args, monkeypatch)
  except BadCommand as e:
    pytest.fail(f"python -m {' '.join(argv)}: {e}")


def test_the_readme_shows_commands():
  modules = {argv[0] for _, argv in _commands(README.read_text())}
  assert {"experiments.train", "experiments.step_cost"} <= modules, modules


def test_inline_config_overrides_name_fields_of_tiny_lm(monkeypatch):
  """`--config.a.b=value` in the README's inline code: a field of configs/tiny_lm.py."""
  text = _FENCE.sub("", README.read_text())
  overrides = []
  for span in re.findall(r"`([^`]+)`", text):
    if "python -m" in span:
      continue
    overrides += [w for w in span.split() if w.startswith("--config.")]
  assert overrides
  for override in overrides:
    try:
      _parse("experiments.train", ["--config=configs/tiny_lm.py", override,
                                   "--workdir=/tmp/unused"], monkeypatch)
    except BadCommand as e:
      pytest.fail(f"{override}: {e}")


def test_a_misspelled_flag_fails(monkeypatch):
  """The check above can fail: a flag, a config field and a config argument that do not exist."""
  for args in (["--config=configs/tiny_lm.py", "--work_dir=/tmp/x"],
               ["--config=configs/tiny_lm.py", "--config.outer.namee=diloco"],
               ["--config=configs/tiny_lm.py", "--config.pipeline.vocab_parallel=maybe"],
               ["--config=configs/tiny_lm.py:size=huge", "--workdir=/tmp/x"]):
    with pytest.raises(BadCommand):
      _parse("experiments.train", args, monkeypatch)


def _links(text: str) -> list[str]:
  text = _FENCE.sub("", text)
  return [t for t in re.findall(r"\]\(([^)\s]+)\)", text)
          if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
  links = _links(page.read_text())
  missing = [t for t in links if not (page.parent / t.split("#")[0]).exists()]
  assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_readme_links_every_results_page():
  links = {(ROOT / t).resolve() for t in _links(README.read_text())}
  pages = set((ROOT / "docs" / "results").glob("*.md"))
  assert pages <= links, sorted(str(p.relative_to(ROOT)) for p in pages - links)


_NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+(?!\d)|\d+)(\.\d+)?")


def _numbers(text: str) -> list[tuple[str, float, int]]:
  """(as written, value, decimals) of every number in `text` (thousands commas allowed)."""
  return [(m[0], float(m[1].replace(",", "") + (m[2] or "")), len(m[2] or "") - bool(m[2]))
          for m in _NUMBER.finditer(text)]


def _results_rows() -> list[str]:
  text = README.read_text(encoding="utf-8")
  table = text[text.index("## Results"):]
  table = table[:table.index("\n## ", 1)]
  return [line for line in table.splitlines()
          if line.startswith("| ") and not line.startswith(("| area", "|---"))]


@pytest.mark.parametrize("row", _results_rows(), ids=lambda row: row.split(" | ")[0][2:])
def test_every_headline_number_stands_on_its_page(row):
  """Each number of a Results headline (a decimal, or a whole number of 100 and more:
  small counts like p=4 match anything) is on a page the row links, as written there or
  to the headline's precision, so a headline cannot drift from the measurement it quotes."""
  headline = row.split(" | ")[1]
  pages = " ".join((ROOT / link).read_text(encoding="utf-8")
                   for link in re.findall(r"\]\(([^)#]+\.md)\)", row))
  on_pages = [value for _, value, _ in _numbers(pages)]
  missing = [written for written, value, decimals in _numbers(headline)
             if (decimals or value >= 100)
             and not any(round(p, decimals) == value for p in on_pages)]
  assert not missing, f"not on the row's pages: {missing}"
