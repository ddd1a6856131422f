"""Every op type name tfspmd looks for is one TensorFlow registers.

tfspmd's rewrites and its runtime keep sets of op type names (the ops
DTensor expands on replicated values, the kernels that cannot fail, the
loop ops, the ops whose inputs a lane guard keeps in range...). A name
misspelled, or an op TensorFlow renames, would silently match nothing:
each set found in tfspmd's modules is checked against TensorFlow's op
registry (DTensor's own ops included).
"""

import importlib
import pkgutil
import re

from tensorflow.experimental import dtensor  # pylint: disable=unused-import
from tensorflow.python.framework import op_def_registry

import tfspmd._src

_OP_TYPE = re.compile(r"_?[A-Z][A-Za-z0-9]*\Z")


def _op_type_sets():
  """`{module.name: names}` for each module-level collection of op types."""
  found = {}
  for module_info in pkgutil.walk_packages(tfspmd._src.__path__,
                                           "tfspmd._src."):
    module = importlib.import_module(module_info.name)
    for name, value in vars(module).items():
      if (isinstance(value, (frozenset, set, tuple)) and value and
          all(isinstance(item, str) and _OP_TYPE.match(item)
              for item in value)):
        found[f"{module_info.name}.{name}"] = value
  return found


def test_every_op_type_name_is_registered():
  found = _op_type_sets()
  # The sets this check exists for are among those found.
  for name in ("tfspmd._src.executors.replicated_ops.EXPANDED",
               "tfspmd._src.executors.run_errors._CANNOT_FAIL",
               "tfspmd._src.core.op_types.LOOPS"):
    assert name in found, sorted(found)
  unknown = {name: sorted(item for item in names
                          if op_def_registry.get(item) is None)
             for name, names in found.items()}
  assert not {name: items for name, items in unknown.items() if items}
