"""A key for a Python function by what it computes, for sharing its traces.

Code that makes a new closure on every call (`pmap(lambda x: x * scale)`
inside a loop, the Lorenz colab's `pplotter`) would trace and compile a new
program each time if programs were kept by function object. Two functions
compute the same program when they have the same code and read the same
values: their closure cells, default arguments and the globals their code
names. `function_key` keys a function by those, where every one of them is
a value that cannot change behind the key's back:

- None, bools, numbers, strings and bytes, by type and value (so `1`,
  `1.0` and `True` differ);
- tuples and frozensets of such values;
- modules, classes and builtins, by identity (a rebinding changes them);
- functions, by their own key, recursively; a `tf.function`, by its
  identity (its options and traces are its own) and its Python function's
  key.

Anything else (a list, a dict, a NumPy array, a `tf.Variable`, an object)
may change in place while the key stays the same, so a function reading one
has no key (None), and is kept by its identity, as before.
"""

import types
import weakref

import tensorflow as tf

from tfspmd._src.core import lru

# How deep functions that read functions are followed before giving up.
_MAX_DEPTH = 8
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_BY_IDENTITY = (types.ModuleType, type, types.BuiltinFunctionType)


class _NoKey(Exception):
  """A value the function reads may change without its key changing."""


def static_value_key(value):
  """A static argument's value as a cache key that tells types apart.

  `1`, `1.0` and `True` are equal and hash alike, so do `(1,)` and
  `(1.0,)`; a function traced for one of them would be reused for the
  others. JAX traces each anew, and so do the programs keyed by this.

  Args:
    value: A hashable value.

  Returns:
    A hashable key equal for values of the same types and values.

  Example:
    >>> static_value_key(1) == static_value_key(1.0)
    False
    >>> static_value_key((1, "a")) == static_value_key((1, "a"))
    True
  """
  if type(value) is tuple:  # pylint: disable=unidiomatic-typecheck
    return ("tuple", tuple(static_value_key(item) for item in value))
  return (type(value), value)


def function_key(fun):
  """A hashable key equal for functions that compute the same, or None.

  Args:
    fun: Any callable.

  Returns:
    None unless `fun` is a plain Python function every value it reads of
    which is keyed as the module docstring says.

  Example:
    >>> def scaled(k):
    ...   return lambda x: x * k
    >>> function_key(scaled(2)) == function_key(scaled(2))
    True
    >>> function_key(scaled(2)) == function_key(scaled(3))
    False
    >>> function_key(lambda x, seen=[]: x) is None
    True
  """
  if not isinstance(fun, types.FunctionType):
    return None
  try:
    return _function(fun, 0)
  except _NoKey:
    return None


def _function(fun, depth):
  if depth > _MAX_DEPTH:
    raise _NoKey
  code = fun.__code__
  cells = tuple(_cell(cell, depth) for cell in fun.__closure__ or ())
  defaults = tuple(_value(v, depth) for v in fun.__defaults__ or ())
  keyword_defaults = tuple(sorted(
      (name, _value(v, depth))
      for name, v in (fun.__kwdefaults__ or {}).items()))
  namespace = fun.__globals__
  read = tuple(sorted(
      (name, _value(namespace[name], depth))
      for name in _global_names(code) if name in namespace))
  return ("function", code, cells, defaults, keyword_defaults, read)


def _cell(cell, depth):
  try:
    contents = cell.cell_contents
  except ValueError:  # an empty cell: a name not yet bound
    raise _NoKey from None
  return _value(contents, depth)


def _global_names(code):
  """The names `code` and the functions defined in it may read as globals."""
  names = set(code.co_names)
  for constant in code.co_consts:
    if isinstance(constant, types.CodeType):
      names |= _global_names(constant)
  return names


def _value(value, depth):
  if isinstance(value, _SCALARS):
    return ("value", type(value), value)
  if type(value) is tuple:  # pylint: disable=unidiomatic-typecheck
    return ("tuple", tuple(_value(item, depth) for item in value))
  if type(value) is frozenset:  # pylint: disable=unidiomatic-typecheck
    return ("frozenset", frozenset(_value(item, depth) for item in value))
  if isinstance(value, _BY_IDENTITY):
    return ("identity", value)
  if isinstance(value, types.FunctionType):
    return _function(value, depth + 1)
  if isinstance(value, tf.types.experimental.PolymorphicFunction):
    python_function = getattr(value, "python_function", None)
    if isinstance(python_function, types.FunctionType):
      return ("tf.function", value, _function(python_function, depth + 1))
  raise _NoKey


class SharedByFunction:
  """Values made for functions (their pmaps), shared by equal functions.

  A function with a key (`function_key`) shares its values with every
  function of that key, in one bounded cache. A plain function without one
  (it reads an array, an object) shares them with itself only: they are
  kept on the function object, so that a dropped function, the arrays it
  captures and the programs made for it are freed together (a cache keyed
  by the function would keep it alive). Another callable (a bound method,
  an object) is kept by identity in the bounded cache.

  Args:
    name: What the values are ('pmap'), to keep apart the kinds of values
      a function holds.

  Example:
    >>> pmaps = SharedByFunction("example")
    >>> def f(x):
    ...   return x
    >>> pmaps.get_or_put(f, ("i",), object) is pmaps.get_or_put(
    ...     f, ("i",), object)
    True
  """

  def __init__(self, name):
    self._name = name
    self._by_key = lru.LRUCache(lru.TRACE_CACHE_SIZE)

  def get_or_put(self, fun, key, make):
    """The value of `fun` and `key` (hashable), or `make()` stored there.

    Raises:
      TypeError: If `fun` or `key` cannot be hashed.
    """
    by_value = function_key(fun)
    if by_value is not None:
      return self._by_key.get_or_put((by_value,) + key, make)
    if isinstance(fun, types.FunctionType):
      hash(key)
      return _held_by(fun, self._name).get_or_put(key, make)
    return self._by_key.get_or_put((fun,) + key, make)


# The attribute of a function holding its values: `(a weak reference to
# the function, {name: LRUCache})`. The reference tells the function's own
# from those `functools.wraps` copied into a wrapper's attributes.
_HELD = "__tfspmd_shared__"


class _Held(tuple):
  """A function's own values; pickled (with the function) as none."""

  def __reduce__(self):
    return _no_values, ()


def _no_values():
  return None


def _held_by(fun, name):
  """The cache of values `fun` holds under `name`, made on first use."""
  held = fun.__dict__.get(_HELD)
  if held is None or held[0]() is not fun:
    held = _Held((weakref.ref(fun), {}))
    fun.__dict__[_HELD] = held
  cache = held[1].get(name)
  if cache is None:
    cache = held[1][name] = lru.LRUCache(lru.TRACE_CACHE_SIZE)
  return cache
