"""Every module of tfspmd imports only from its own layer and those below.

The layers and their modules are the table of docs/architecture.md; this
test reads it, so the document and the code cannot drift apart. Each layer
below the public API is the folder of tfspmd/_src/ named after it and the
table names its modules from that folder, so a module in another layer's
folder is one the table does not list. Imports are read from the source
(module-level and inside functions alike), without importing anything.
"""

import ast
import os
import re

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_PATH = os.path.join(_ROOT, "docs", "architecture.md")
PACKAGE = os.path.join(_ROOT, "tfspmd")
# The one layer that is no folder of tfspmd/_src/: the table names its
# modules in full.
PUBLIC_API = "public API"


def declared_layers():
  """{module: (rank, layer)} from the doc's table, rank 0 the lowest layer."""
  with open(DOC_PATH) as f:
    text = f.read()
  table = text.split("## Layers, from the top", 1)[1].split("\n## ", 1)[0]
  rows = [line for line in table.splitlines()
          if line.startswith("| ") and not line.startswith(("| layer", "| ---"))]
  layers = {}
  for rank, row in enumerate(reversed(rows)):
    layer, modules = [cell.strip() for cell in row.strip("|").split("|")][:2]
    names = re.findall(r"`([\w.]+)`", modules)
    if layer != PUBLIC_API:
      # The layer's folder, its __init__ included, then its modules.
      folder = f"tfspmd._src.{layer}"
      names = [folder] + [f"{folder}.{name}" for name in names]
    for full in names:
      assert full not in layers, f"{full} is in two layers"
      layers[full] = (rank, layer)
  return layers


def package_modules():
  """{dotted module name: path} of every module under tfspmd/."""
  modules = {}
  for directory, _, files in os.walk(PACKAGE):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(directory, name)
        dotted = os.path.relpath(path, _ROOT)[:-3].replace(os.sep, ".")
        modules[dotted.removesuffix(".__init__")] = path
  return modules


def imported_names(path, dotted):
  """(line, module name) of every import in the file, relative ones resolved."""
  package = dotted if path.endswith("__init__.py") else dotted.rsplit(".", 1)[0]
  with open(path) as f:
    tree = ast.parse(f.read())
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{parent}.{base}" if base else parent
      yield node.lineno, base
      for alias in node.names:
        yield node.lineno, f"{base}.{alias.name}"


LAYERS = declared_layers()
MODULES = package_modules()
# The private package's own __init__ holds nothing but its docstring.
UNLAYERED = {"tfspmd._src"}


def test_every_module_has_one_layer():
  unlisted = sorted(set(MODULES) - set(LAYERS) - UNLAYERED)
  assert not unlisted, f"modules missing from docs/architecture.md: {unlisted}"
  gone = sorted(set(LAYERS) - set(MODULES))
  assert not gone, f"docs/architecture.md lists modules that do not exist: {gone}"


@pytest.mark.parametrize("module", sorted(set(MODULES) - UNLAYERED))
def test_imports_go_down(module):
  rank, layer = LAYERS[module]
  upward = sorted({
      f"line {line}: {name} ({LAYERS[name][1]})"
      for line, name in imported_names(MODULES[module], module)
      if name in LAYERS and name != module and LAYERS[name][0] > rank})
  assert not upward, f"{module} ({layer}) imports a higher layer: {upward}"


@pytest.mark.parametrize("module", sorted(set(MODULES) - UNLAYERED))
def test_private_tensorflow_only_through_tf_internal(module):
  if module == "tfspmd._src.core.tf_internal":
    return
  private = sorted({f"line {line}: {name}"
                    for line, name in imported_names(MODULES[module], module)
                    if name.startswith("tensorflow.python")})
  assert not private, f"{module} imports private TensorFlow: {private}"


@pytest.mark.parametrize(
    "layer", sorted({layer for _, layer in LAYERS.values()} - {PUBLIC_API}))
def test_a_layer_folder_holds_only_its_docstring(layer):
  with open(os.path.join(PACKAGE, "_src", layer, "__init__.py")) as f:
    body = ast.parse(f.read()).body
  assert [type(node) for node in body] == [ast.Expr], (
      f"tfspmd/_src/{layer}/__init__.py holds more than its docstring: "
      f"import from the layer's modules instead")
  assert isinstance(body[0].value, ast.Constant)


def test_the_layers_are_ordered_as_documented():
  by_rank = sorted({rank_layer for rank_layer in LAYERS.values()})
  assert [layer for _, layer in by_rank] == [
      "core", "trees", "executors", "runtime", "rewrites", "collectives",
      "arguments",
      "programs", "multiprocess", "public API"]


def test_the_single_process_runtime_never_loads_the_multiprocess_layer():
  multiprocess = {name for name, (_, layer) in LAYERS.items()
                  if layer == "multiprocess"}
  below = {name for name, (rank, _) in LAYERS.items()
           if rank < LAYERS["tfspmd._src.multiprocess.distributed"][0]}
  reached = {}
  for module in below:
    for line, name in imported_names(MODULES[module], module):
      if name in multiprocess:
        reached[module] = (line, name)
  assert not reached
