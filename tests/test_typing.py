"""The public API carries type annotations, as the shipped `py.typed` promises.

Every public callable (each name of `tfspmd.__all__`, of `tfspmd.lax`, of
`tfspmd.distributed`, `tfspmd.sharding`, `tfspmd.tree_util` and `tfspmd.tree`,
and of the public modules of `tfspmd.adapters`) has every parameter and its
return annotated, and `typing.get_type_hints` resolves the annotations. For
a class, that holds for its constructor and its public methods and
properties. Type aliases (`tree_util.KeyPath`) and another library's classes
re-exported as they are (optree's `PyTreeDef`) have nothing of tfspmd's to
check.
"""

import importlib
import inspect
import pathlib
import pkgutil
import types
import typing

import pytest

import tfspmd
import tfspmd.adapters

# Methods with a leading underscore that users still call.
_PUBLIC_DUNDERS = ("__init__", "__new__", "__call__", "__iter__")


def _adapter_modules():
  return [importlib.import_module(f"tfspmd.adapters.{info.name}")
          for info in pkgutil.iter_modules(tfspmd.adapters.__path__)
          if not info.name.startswith("_")]


def _public_names(module):
  """`__all__`, or else the public functions and classes the module defines."""
  if hasattr(module, "__all__"):
    return list(module.__all__)
  return sorted(
      name for name, value in vars(module).items()
      if not name.startswith("_") and
      (inspect.isfunction(value) or inspect.isclass(value)) and
      value.__module__ == module.__name__)


def _class_callables(cls, qualname):
  """`(name, function)` of the constructor and public members `cls` defines."""
  found = []
  for name, member in vars(cls).items():
    if name.startswith("_") and name not in _PUBLIC_DUNDERS:
      continue
    if isinstance(member, (staticmethod, classmethod)):
      member = member.__func__
    if isinstance(member, property):
      for accessor in ("fget", "fset"):
        function = getattr(member, accessor)
        if function is not None:
          found.append((f"{qualname}.{name}.{accessor}", function))
    elif inspect.isfunction(member) and member.__module__.startswith("tfspmd"):
      # Another library's function put there (Enum's __new__) is its to annotate.
      found.append((f"{qualname}.{name}", member))
  return found


def _is_type_alias(value):
  """A name for a type, such as `tree_util.KeyPath`: nothing to call."""
  return value is typing.Any or typing.get_origin(value) is not None


def _defined_elsewhere(value):
  """A class another library defines and annotates (optree's `PyTreeDef`)."""
  return inspect.isclass(value) and not value.__module__.startswith("tfspmd")


def _walk(module, seen):
  """`(qualified name, object)` of every public callable under `module`."""
  found = []
  for name in _public_names(module):
    value = getattr(module, name)
    qualname = f"{module.__name__}.{name}"
    if _is_type_alias(value) or _defined_elsewhere(value):
      continue
    if isinstance(value, types.ModuleType):
      if value.__name__ not in seen:
        seen.add(value.__name__)
        found += _walk(value, seen)
    elif inspect.isclass(value):
      found.append((qualname, value))
      found += _class_callables(value, qualname)
    elif callable(value):
      found.append((qualname, value))
    else:  # a settings object such as tfspmd.config: its class's methods
      found += _class_callables(type(value), qualname)
  return found


def _public_callables():
  seen = {"tfspmd"}
  found = _walk(tfspmd, seen)
  for module in _adapter_modules():
    found += _walk(module, seen)
  return found


_CALLABLES = _public_callables()


def test_the_walk_covers_the_api():
  names = {name for name, _ in _CALLABLES}
  for expected in ("tfspmd.pmap", "tfspmd.lax.psum",
                   "tfspmd.distributed.initialize",
                   "tfspmd.ShardedArray.reshape", "tfspmd.Mesh.shape.fget",
                   "tfspmd.config.update",
                   "tfspmd.tree_util.tree_map",
                   "tfspmd.tree_util.register_dataclass",
                   "tfspmd.tree_util.DictKey.__init__", "tfspmd.tree.map",
                   "tfspmd.sharding.NamedSharding.__init__",
                   "tfspmd.device_put", "tfspmd.ShardedArray.sharding.fget",
                   "tfspmd.adapters.tf_data.device_batches",
                   "tfspmd.adapters.checkpoint.restore",
                   "tfspmd.adapters.keras_training.KerasTrainer.fit"):
    assert expected in names


@pytest.mark.parametrize("name, value", _CALLABLES,
                         ids=[name for name, _ in _CALLABLES])
def test_annotated(name, value):
  hints = typing.get_type_hints(value)  # raises if a name does not resolve
  if inspect.isclass(value):
    return  # its fields are resolved above, its methods checked one by one
  parameters = list(inspect.signature(value).parameters.values())
  if parameters and parameters[0].name in ("self", "cls"):
    parameters = parameters[1:]
  missing = [p.name for p in parameters if p.name not in hints]
  assert not missing, f"{name}: parameters without annotations: {missing}"
  assert "return" in hints, f"{name}: no return annotation"


def test_py_typed_ships_in_the_package():
  assert (pathlib.Path(tfspmd.__file__).parent / "py.typed").is_file()
