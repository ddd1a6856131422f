"""vmap: vectorize a function over an axis of its arguments, on one device.

The same pfor vectorization as one level of pmap, with no mesh dimension:
the mapped axis stays a plain tensor axis. A named vmap axis takes part in
collectives like a pmap axis (`psum` over it sums along the axis), inside
or around pmaps.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable
import functools
from typing import Any

import numpy as np
import tensorflow as tf

from tfspmd._src.arguments import arguments
from tfspmd._src.arguments import mapped_args
from tfspmd._src.core import function_keys
from tfspmd._src.core import lru
from tfspmd._src.core.config import config
from tfspmd._src.programs import vectorize
from tfspmd._src.rewrites import side_effects
from tfspmd._src.runtime import axis_env
from tfspmd._src.trees import tree

_do_not_convert = tf.autograph.experimental.do_not_convert


class VmappedFunction:
  """The callable `vmap` returns; call it like the function it maps."""

  def __init__(self, fun, in_axes, out_axes, axis_name, axis_size,
               spmd_axis_name):
    if not callable(fun):
      raise TypeError(f"vmap: `fun` must be callable, got {fun!r}.")
    _check_spmd_axis_name(spmd_axis_name)
    arguments.check_axis_spec_tree(out_axes, "out_axes")
    self._args = mapped_args.MappedArguments("vmap", in_axes, (), axis_size)
    self._fun = fun
    self._axis_name = axis_env.checked_axis_name(axis_name, fun, "vmap")
    self._out_axes = out_axes
    # One traced function per call signature (tree, shapes, dtypes),
    # bounded as pmap's programs are.
    self._functions = lru.LRUCache(lru.TRACE_CACHE_SIZE)
    functools.update_wrapper(self, fun, updated=())

  def __repr__(self):
    return f"<vmap of {self._fun!r} over axis {self._axis_name!r}>"

  def __get__(self, instance, owner):
    if instance is None:
      return self
    return functools.partial(self, instance)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    if tf.inside_function():
      return self._vectorize(args, kwargs)
    # pfor builds a graph: outside one, each call signature gets a traced
    # function of its own. It returns the output's leaves, as TensorFlow
    # knows no registered nodes; the output tree is kept beside it. Python
    # values passed as they are (`_passed_through`) are part of the
    # signature, as static arguments are of a pmap's.
    call = self._args.bind(args, kwargs)
    passed = _passed_through(call)
    tensors = [_to_tensor(leaf) for k, leaf in enumerate(call.leaves)
               if k not in passed]
    values = tuple((k, function_keys.static_value_key(call.leaves[k]))
                   for k in sorted(passed))
    key = (call.treedef, values,
           tuple((tuple(t.shape), t.dtype) for t in tensors))
    traced = self._functions.get(key)
    if traced is None:
      traced = self._trace(call.treedef, dict(
          (k, call.leaves[k]) for k in passed), tensors)
      self._functions.put(key, traced)
    function, output_treedef = traced
    return output_treedef.unflatten(function(*tensors))

  def _trace(self, treedef, passed, tensors):
    """`(concrete function of the leaves, output treedef)` for one signature.

    Args:
      treedef: The tree of the call's arguments, `(args, kwargs)`.
      passed: The leaves given to `fun` as they are, by position.
      tensors: The other leaves, in order.
    """
    output = tree.OutputTree()

    def flat_call(*flat):
      leaves = iter(flat)
      every = [passed[k] if k in passed else next(leaves)
               for k in range(treedef.num_leaves)]
      return output.leaves_of(self._vectorize(*treedef.unflatten(every)))

    function = tf.function(_do_not_convert(flat_call), autograph=False)
    return function.get_concrete_function(*tensors), output.treedef

  def _vectorize(self, args, kwargs):
    axis_env.check_not_bound(self._axis_name, "vmap")
    call = self._args.bind(args, kwargs)
    paths = call.paths
    passed = _passed_through(call)
    values = [leaf if k in passed else _traced_tensor(leaf, path)
              for k, (leaf, path) in enumerate(zip(call.leaves, paths))]
    shapes = [() if k in passed else tuple(v.shape)
              for k, v in enumerate(values)]
    axes, size = self._args.axes_and_size(call.in_axes, shapes, paths)
    state = axis_env.trace_state()
    result = vectorize.map_over_axis(
        self._fun, frame_template=(self._axis_name, size, None),
        inputs=values, in_axes=axes,
        rebuild_args=call.rebuilder(),
        out_axes=self._out_axes,
        on_slice=None if state is None else state.slice_tracker(values, axes))
    side_effects.replay_in_graph(result.effects)
    return result.treedef.unflatten(result.values)


# Python values that are no arrays: with in_axes None, `fun` gets them as
# they are.
_PYTHON_VALUES = (bool, int, float, complex, str)


def _passed_through(call):
  """The positions of the leaves `fun` gets as they are, not as tensors.

  As in jax.vmap, an argument with in_axes None that is a Python bool,
  number or string reaches every slice as it is, so `fun` can branch on it
  in Python (`if flag:`); NumPy values become tensors.

  Args:
    call: The call's `mapped_args.BoundCall`.
  """
  return frozenset(
      k for k, (leaf, axis) in enumerate(zip(call.leaves, call.in_axes))
      if axis is None and isinstance(leaf, _PYTHON_VALUES))


def _check_spmd_axis_name(spmd_axis_name):
  """Checks `spmd_axis_name`: None, an axis name, or a tuple of names.

  It is accepted and has no effect: the values JAX computes with it are the
  values without it (it only places the vmapped axis over the mesh axis).
  """
  try:
    hash(spmd_axis_name)  # so is a tuple of hashable names
  except TypeError:
    raise TypeError(
        f"vmap: `spmd_axis_name` must be None, an axis name or a tuple of "
        f"axis names, got {spmd_axis_name!r}.") from None


def _to_tensor(leaf):
  if isinstance(leaf, tf.Tensor):
    return leaf
  if isinstance(leaf, (np.ndarray, np.generic)):
    leaf = config.narrowed(np.asarray(leaf))
  return tf.convert_to_tensor(leaf)


def _traced_tensor(leaf, path):
  if isinstance(leaf, tf.Tensor):
    return leaf
  return tf.convert_to_tensor(arguments.to_array_leaf(leaf, path))


def vmap(
    fun: Callable[..., Any] | None = None,
    in_axes: Any = 0,
    out_axes: Any = 0,
    axis_name: Hashable | None = None,
    axis_size: int | None = None,
    spmd_axis_name: Hashable | tuple[Hashable, ...] | None = None,
) -> Callable[..., Any]:
  """Vectorizes `fun` over an axis of its arguments, like `jax.vmap`.

  `fun` is written for one slice; the result stacks its outputs along
  `out_axes`. With an `axis_name`, collectives inside `fun` (and inside
  pmaps or vmaps nested in it) can name the axis: `psum` over it sums the
  slices, `axis_index` is the slice's position, and so on. Inside a pmap,
  a vmap adds an axis that stays on each device.

  Args:
    fun: The per-slice function; tensors, NumPy arrays or Python numbers in
      tuples, lists, dicts or namedtuples in and out.
    in_axes: For each positional argument, the axis to map over (negative
      counts from the end), None to pass it whole to every slice, or a tree
      prefix of the arguments holding those. Keyword arguments are mapped
      over axis 0. As in `jax.vmap`, a Python bool, number or string passed
      whole (None) reaches `fun` as it is, so `fun` may branch on it in
      Python; each such value gets a trace of its own.
    out_axes: Where the mapped axis goes in each output (None for an output
      that is the same for every slice), or a tree prefix of the output.
    axis_name: A hashable name for the axis, for collectives.
    axis_size: The axis size when no argument is mapped.
    spmd_axis_name: JAX's name of the pmap or shard_map mesh axis (or
      axes) to also split the vmapped axis over. Accepted for JAX's code,
      with no effect: the values are those JAX gives, and the vmapped axis
      stays whole on each device (tfspmd's vmap adds no mesh dimension).

  Returns:
    A callable with `fun`'s arguments (with the extra mapped axis) that
    returns `tf.Tensor`s.

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> print(tfspmd.vmap(lambda x: x * 2)(tf.range(3)))
    tf.Tensor([0 2 4], shape=(3,), dtype=int32)
    >>> center = lambda x: x - tfspmd.lax.pmean(x, 'b')
    >>> print(tfspmd.vmap(center, axis_name='b')(tf.constant([1., 2., 6.])))
    tf.Tensor([-2. -1.  3.], shape=(3,), dtype=float32)
  """
  if fun is None:
    return functools.partial(vmap, in_axes=in_axes, out_axes=out_axes,
                             axis_name=axis_name, axis_size=axis_size,
                             spmd_axis_name=spmd_axis_name)
  return VmappedFunction(fun, in_axes, out_axes, axis_name, axis_size,
                         spmd_axis_name)
