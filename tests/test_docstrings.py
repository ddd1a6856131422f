"""Runs the examples in tfspmd's docstrings (on 8 logical CPU devices)."""

import doctest
import importlib
import pkgutil

import pytest

import tfspmd
import tfspmd.adapters


def _modules():
  names = ["tfspmd", "tfspmd.distributed", "tfspmd.lax", "tfspmd.sharding",
           "tfspmd.tree", "tfspmd.tree_util", "tfspmd.adapters"]
  for info in pkgutil.walk_packages(tfspmd.__path__, "tfspmd."):
    names.append(info.name)
  for info in pkgutil.walk_packages(tfspmd.adapters.__path__,
                                    "tfspmd.adapters."):
    names.append(info.name)
  return sorted(set(names))


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


def test_public_functions_have_examples():
  missing = []
  for module in (tfspmd, tfspmd.distributed, tfspmd.lax, tfspmd.sharding,
                 tfspmd.tree, tfspmd.tree_util):
    for name in module.__all__:
      value = getattr(module, name)
      # Type aliases and another library's classes (tree_util.PyTreeDef is
      # optree's) carry that library's docs.
      ours = getattr(value, "__module__", "").startswith("tfspmd")
      if callable(value) and ours and ">>>" not in (value.__doc__ or ""):
        missing.append(f"{module.__name__}.{name}")
  assert not missing, f"public names without a docstring example: {missing}"


ADAPTERS_PUBLIC = [
    "tfspmd.adapters.data_parallel",
    "tfspmd.adapters.checkpoint.restore",
    "tfspmd.adapters.checkpoint.save",
    "tfspmd.adapters.keras_training.KerasTrainer",
    "tfspmd.adapters.tf_data.dataset_elements",
    "tfspmd.adapters.tf_data.device_batches",
]


@pytest.mark.parametrize("name", ADAPTERS_PUBLIC)
def test_adapters_public_names_have_examples(name):
  module_name, attribute = name.rsplit(".", 1)
  value = getattr(importlib.import_module(module_name), attribute)
  assert ">>>" in (value.__doc__ or ""), f"{name} has no docstring example"
