"""docs/api.md, the API reference, is the public names' docstrings as they are.

The page is generated from the code: each public module's names (its
`__all__`), and the adapters' public functions and classes, with their
signatures and docstrings. A test keeps the page equal to what the code
says. After changing a docstring or a public name, rewrite the page with

  TFSPMD_WRITE_API_DOC=1 .venv/bin/python -m pytest -q tests/test_api_doc.py
"""

import importlib
import inspect
import os
import re
import types

import tfspmd

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PAGE = os.path.join(_ROOT, "docs", "api.md")

# (module, names): the module's `__all__` where names is None.
_SECTIONS = (
    ("tfspmd", None),
    ("tfspmd.lax", None),
    ("tfspmd.sharding", None),
    ("tfspmd.distributed", None),
    ("tfspmd.tree_util", None),
    ("tfspmd.experimental.shard_map", ("shard_map",)),
    ("tfspmd.experimental.mesh_utils", None),
    ("tfspmd.experimental.multihost_utils", None),
    ("tfspmd.adapters", ("data_parallel",)),
    ("tfspmd.adapters.keras_training", ("KerasTrainer",)),
    ("tfspmd.adapters.tf_data", ("device_batches", "dataset_elements",
                                 "pad_rows")),
    ("tfspmd.adapters.checkpoint", ("save", "restore")),
)


def _signature(value):
  try:
    text = str(inspect.signature(value))
  except (TypeError, ValueError):
    return "(...)"
  # A sentinel default (a plain object) would print its address.
  return re.sub(r"<object object at 0x[0-9a-f]+>", "<not given>", text)


def _entry(module_name, name, value):
  """The Markdown of one public name."""
  title = f"### `{module_name}.{name}`"
  if isinstance(value, types.ModuleType):
    summary = (inspect.getdoc(value) or "").split("\n\n")[0]
    return [title, "", f"A module: {summary}" if summary else "A module.", ""]
  ours = getattr(value, "__module__", "") or ""
  if not (callable(value) and (ours.startswith("tfspmd") or
                               ours.startswith("adapters"))):
    # A type alias, a constant or another library's class (optree's
    # PyTreeDef) carries that library's documentation.
    kind = type(value).__name__
    return [title, "", f"`{kind}`" + (f" from `{ours}`" if ours else "")
            + ".", ""]
  lines = [title, ""]
  if inspect.isclass(value):
    lines += ["```python", f"class {name}{_signature(value)}", "```", ""]
  else:
    lines += ["```python", f"{name}{_signature(value)}", "```", ""]
  doc = inspect.getdoc(value)
  if doc:
    lines += ["```text", doc, "```", ""]
  if inspect.isclass(value):
    for member, method in sorted(vars(value).items()):
      if member.startswith("_") or not callable(method) or isinstance(
          method, type):
        continue
      method = getattr(value, member)
      lines += [f"#### `{name}.{member}{_signature(method)}`", ""]
      method_doc = inspect.getdoc(method)
      if method_doc:
        lines += ["```text", method_doc, "```", ""]
  return lines


def api_page():
  """The text of docs/api.md."""
  lines = [
      "# API reference",
      "",
      "Generated from the docstrings by `tests/test_api_doc.py`, which keeps "
      "this page equal to",
      "the code (rewrite it with `TFSPMD_WRITE_API_DOC=1 .venv/bin/python -m "
      "pytest -q",
      "tests/test_api_doc.py`). Each example in a docstring runs in "
      "`tests/test_docstrings.py`.",
      "",
  ]
  for module_name, names in _SECTIONS:
    module = importlib.import_module(module_name)
    names = names or tuple(module.__all__)
    lines += [f"## `{module_name}`", ""]
    summary = (inspect.getdoc(module) or "").split("\n\n")[0]
    if summary:
      lines += [summary, ""]
    for name in names:
      lines += _entry(module_name, name, getattr(module, name))
  return "\n".join(lines).rstrip("\n") + "\n"


def test_the_api_page_is_the_docstrings_as_they_are():
  page = api_page()
  if os.environ.get("TFSPMD_WRITE_API_DOC"):
    with open(_PAGE, "w", encoding="utf-8") as f:
      f.write(page)
  with open(_PAGE, encoding="utf-8") as f:
    assert f.read() == page, (
        "docs/api.md differs from the docstrings; rewrite it with "
        "TFSPMD_WRITE_API_DOC=1 .venv/bin/python -m pytest -q "
        "tests/test_api_doc.py")


def test_every_public_name_is_on_the_page():
  with open(_PAGE, encoding="utf-8") as f:
    page = f.read()
  for name in tfspmd.__all__:
    assert f"### `tfspmd.{name}`" in page, name
  for name in tfspmd.lax.__all__:
    assert f"### `tfspmd.lax.{name}`" in page, name
