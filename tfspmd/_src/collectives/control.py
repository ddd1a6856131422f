"""`jax.lax`'s structured control flow over pytrees, on TensorFlow's.

`scan`, `fori_loop`, `while_loop`, `cond`, `switch` and `map` take JAX's
arguments (functions of pytrees) and build `tf.while_loop`, `tf.cond` and
`tf.switch_case` over the flattened leaves, so that they vectorize inside a
pmap as TensorFlow's own control flow does, collectives in their bodies
included. Eagerly (debug mode's device threads among others) they run as
TensorFlow's control flow runs eagerly: Python loops and the taken branch.

JAX requires a loop's carry to keep its tree, shapes and dtypes from one
iteration to the next, and the branches of a conditional to agree; each
function checks the same, and says which leaf differs, before TensorFlow
would fail with a message about its own flattened loop variables.
"""

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfspmd._src.core import tf_internal
from tfspmd._src.trees import tree


class _Signature:
  """The tree, dtypes and static shapes of a pytree of tensors."""

  def __init__(self, value, function, name):
    leaves, self.treedef = tree.flatten(value)
    paths = tree.leaf_paths(value, name)
    self.leaves = [_to_tensor(leaf, function, path)
                   for leaf, path in zip(leaves, paths)]
    self.paths = paths
    self.name = name

  def check(self, other, function, what):
    """Raises TypeError unless `other` has this signature.

    Args:
      other: Another `_Signature` (what the body or branch returned).
      function: The lax function's name, for the message.
      what: How the message names the mismatch, e.g. "the carry that f
        returns must match init".
    """
    if other.treedef != self.treedef:
      raise TypeError(
          f"tfspmd.lax.{function}: {what}, as in jax.lax.{function}, but "
          f"{self.name} has the structure {tree.describe(self.treedef)} and "
          f"{other.name} has {tree.describe(other.treedef)}.")
    for path, mine, theirs in zip(self.paths, self.leaves, other.leaves):
      if (mine.dtype != theirs.dtype or
          not mine.shape.is_compatible_with(theirs.shape)):
        where = other.name + path[len(self.name):]
        raise TypeError(
            f"tfspmd.lax.{function}: {what}, as in jax.lax.{function}, but "
            f"{path} is {_describe(mine)} and {where} is "
            f"{_describe(theirs)}; cast it (tf.cast) or reshape it to match.")


def _describe(tensor):
  return f"{tensor.dtype.name}{tensor.shape.as_list()}"


def _to_tensor(leaf, function, path):
  if isinstance(leaf, tf.Tensor):
    return leaf
  try:
    return tf.convert_to_tensor(leaf)
  except (TypeError, ValueError):
    raise TypeError(
        f"tfspmd.lax.{function}: {path} is {type(leaf).__name__} "
        f"{leaf!r}, not an array; a pytree given to jax.lax.{function} holds "
        f"tensors, arrays and numbers only (pass other values through the "
        f"closure instead).") from None


def _function_check(fun, function, name):
  if not callable(fun):
    raise TypeError(
        f"tfspmd.lax.{function}: {name} must be a function, got "
        f"{type(fun).__name__} {fun!r}.")


# --- loops -------------------------------------------------------------------


def _loop(function, cond_of, body_of, init, names, what, iterations=None):
  """A `tf.while_loop` over the leaves of `init`, checked as JAX's loops.

  Args:
    function: The lax function's name, for messages.
    cond_of: A function of the carry's pytree giving a scalar bool.
    body_of: A function of the carry's pytree giving the next one.
    init: The carry's first value, a pytree.
    names: How messages name `init` and the body's result.
    what: How messages say what the body must keep.
    iterations: The number of passes where it is known, for gradients of
      the loop compiled by XLA; None for a loop of unknown length.

  Returns:
    The final carry, a pytree of `init`'s structure.
  """
  start = _Signature(init, function, names[0])
  count = len(start.leaves)

  def condition(*leaves):
    return cond_of(start.treedef.unflatten(leaves[:count]))

  def body(*leaves):
    out = _Signature(body_of(start.treedef.unflatten(leaves[:count])),
                     function, names[1])
    start.check(out, function, what)
    return _keeping_shapes(out.leaves, start.leaves) + list(leaves[count:])

  # tf.while_loop needs a loop variable: a loop that carries nothing (run
  # for its effects) gets one that nothing reads.
  final = tf.while_loop(condition, body, start.leaves or [tf.constant(0)],
                        maximum_iterations=iterations)
  if not isinstance(final, (list, tuple)):
    final = [final]
  return start.treedef.unflatten(list(final)[:count])


def _keeping_shapes(new_leaves, old_leaves):
  """`new_leaves`, each with its static shape at least the old one's.

  A leaf whose shape the body left less known than the carry's (compatible,
  as checked) would fail TensorFlow's check of the loop's shapes.
  """
  return [new if new.shape.is_subtype_of(old.shape)
          else tf.ensure_shape(new, old.shape)
          for new, old in zip(new_leaves, old_leaves)]


def while_loop(cond_fun: Callable[[Any], Any], body_fun: Callable[[Any], Any],
               init_val: Any) -> Any:
  """Runs `body_fun` while `cond_fun` holds, as `jax.lax.while_loop`.

  A `tf.while_loop` over the leaves of `init_val`: inside a pmap the
  predicate and the carry may differ per device, and the bodies may call
  collectives (every device must then run as many passes).

  Args:
    cond_fun: A function of the carry giving a scalar bool.
    body_fun: A function of the carry giving the next carry, of the same
      tree, dtypes and shapes.
    init_val: The first carry, a pytree of tensors, arrays and numbers.

  Returns:
    The carry once `cond_fun` is False.

  Raises:
    TypeError: If `body_fun` changes the carry's tree, a dtype or a shape,
      or `cond_fun` does not give a scalar bool.

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> from tfspmd import lax
    >>> print(lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * 2),
    ...                      (0, 1.))[1])
    tf.Tensor(32.0, shape=(), dtype=float32)
  """
  _function_check(cond_fun, "while_loop", "cond_fun")
  _function_check(body_fun, "while_loop", "body_fun")
  return _loop("while_loop", _predicate(cond_fun), body_fun, init_val,
               ("init_val", "body_fun's result"),
               "body_fun must return a carry like init_val")


def _predicate(cond_fun):
  def predicate(carry):
    value = tf.convert_to_tensor(cond_fun(carry))
    if value.dtype != tf.bool or value.shape.rank != 0:
      raise TypeError(
          f"tfspmd.lax.while_loop: cond_fun must return a scalar bool, as in "
          f"jax.lax.while_loop, but returned {_describe(value)}; reduce it "
          f"(tf.reduce_all) or compare it first.")
    return value
  return predicate


def _bound(value, name):
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, np.integer, tf.Tensor, tf.Variable)):
    raise TypeError(
        f"tfspmd.lax.fori_loop: {name} must be an integer (a Python int or "
        f"an integer scalar tensor), as in jax.lax.fori_loop, got "
        f"{type(value).__name__} {value!r}.")
  if isinstance(value, (int, np.integer)):
    return int(value)
  if not value.dtype.is_integer or value.shape.rank != 0:
    raise TypeError(
        f"tfspmd.lax.fori_loop: {name} must be an integer scalar, as in "
        f"jax.lax.fori_loop, got {_describe(value)}.")
  return value


def fori_loop(lower: int | tf.Tensor, upper: int | tf.Tensor,
              body_fun: Callable[[Any, Any], Any], init_val: Any, *,
              unroll: int | bool | None = None) -> Any:
  """`body_fun(i, val)` for `i` from `lower` to `upper`, as `jax.lax.fori_loop`.

  With Python int bounds the loop has a known length, which its gradient
  needs under XLA, as JAX's then becomes a scan. `unroll` is taken and
  changes nothing: the values are the same.

  Args:
    lower: The first index, an int or an integer scalar tensor.
    upper: The index the loop stops before.
    body_fun: A function of the index and the carry giving the next carry.
    init_val: The first carry, a pytree.
    unroll: Accepted for JAX's signature.

  Returns:
    The last carry.

  Raises:
    TypeError: If a bound is not an integer scalar, or `body_fun` changes
      the carry's tree, a dtype or a shape.

  Example:
    >>> from tfspmd import lax
    >>> print(lax.fori_loop(0, 4, lambda i, total: total + i, 10))
    tf.Tensor(16, shape=(), dtype=int32)
  """
  del unroll  # XLA decides; the values do not change.
  _function_check(body_fun, "fori_loop", "body_fun")
  lower, upper = _bound(lower, "lower"), _bound(upper, "upper")
  iterations = None
  if isinstance(lower, int) and isinstance(upper, int):
    iterations = max(upper - lower, 0)
    index_dtype = tf.int32
  else:
    dtypes = {v.dtype for v in (lower, upper) if not isinstance(v, int)}
    index_dtype = dtypes.pop() if len(dtypes) == 1 else None
    if index_dtype is None:
      raise TypeError(
          f"tfspmd.lax.fori_loop: lower and upper must have one dtype, as in "
          f"jax.lax.fori_loop, got {lower.dtype.name} and "
          f"{upper.dtype.name}; cast one of them.")
  lower = tf.cast(lower, index_dtype)
  upper = tf.cast(upper, index_dtype)
  what = "body_fun must return a carry like init_val"
  start = _Signature(init_val, "fori_loop", "init_val")

  def step(carry):
    out = _Signature(body_fun(carry[0], carry[1]), "fori_loop",
                     "body_fun's result")
    start.check(out, "fori_loop", what)
    return carry[0] + 1, start.treedef.unflatten(out.leaves)

  carry = _loop("fori_loop", lambda c: c[0] < upper, step,
                (lower, start.treedef.unflatten(start.leaves)),
                ("(i, init_val)", "(i, body_fun's result)"), what, iterations)
  return carry[1]


def _leading_length(xs_leaves, xs_paths, length):
  """The scan's length: `length`, or the leading axis every xs leaf shares."""
  sizes = []
  for leaf, path in zip(xs_leaves, xs_paths):
    if leaf.shape.rank == 0:
      raise ValueError(
          f"tfspmd.lax.scan: {path} is a scalar; every leaf of xs needs a "
          f"leading axis to scan over, as in jax.lax.scan.")
    sizes.append(tf.compat.dimension_value(leaf.shape[0]))
  known = {size for size in sizes if size is not None}
  if length is not None:
    known.add(int(length))
  if len(known) > 1:
    given = ", ".join(f"{path} {size}" for path, size in zip(xs_paths, sizes))
    if length is not None:
      given += f", length={length}"
    raise ValueError(
        f"tfspmd.lax.scan: the leaves of xs must share their leading axis "
        f"size, and length must equal it, as in jax.lax.scan; got {given}.")
  if known:
    return known.pop()
  if not xs_leaves:
    raise ValueError(
        "tfspmd.lax.scan: xs has no leaves and no length was given; pass "
        "length=n to scan n times, as in jax.lax.scan.")
  return tf.shape(xs_leaves[0])[0]


def scan(f: Callable[[Any, Any], tuple[Any, Any]], init: Any,
         xs: Any = None, length: int | None = None, reverse: bool = False,
         unroll: int | bool = 1) -> tuple[Any, Any]:
  """Loops `f(carry, x)` over the leading axis of `xs`, as `jax.lax.scan`.

  Returns the last carry and the `y`s stacked along a new leading axis (a
  `None` y stacks to None). With `reverse=True` the loop runs from the end,
  and `ys[i]` is still what `f` returned for `xs[i]`. Inside a tf.function
  or a pmap it is a `tf.while_loop` reading and writing `tf.TensorArray`s,
  with the collectives of `f` inside; `f` is traced once more beforehand
  to learn the dtypes and shapes of its `y`s. `unroll` is taken and changes
  nothing: the values are the same.

  Args:
    f: A function of the carry and one slice of `xs` giving `(carry, y)`.
    init: The first carry, a pytree.
    xs: A pytree of tensors sharing a leading axis, or None.
    length: The number of steps: required when `xs` is None, else it must
      equal the leading axis.
    reverse: Whether to run from the last slice to the first.
    unroll: Accepted for JAX's signature.

  Returns:
    `(carry, ys)`.

  Raises:
    TypeError: If `f` does not return a pair, or changes the carry's tree, a
      dtype or a shape, or its `y`s differ between steps.
    ValueError: If the leaves of `xs` differ in length, or disagree with
      `length`, or neither gives one.

  Example:
    >>> import tensorflow as tf
    >>> from tfspmd import lax
    >>> total, partial = lax.scan(lambda c, x: (c + x, c + x), 0., tf.range(4.))
    >>> print(total, partial)
    tf.Tensor(6.0, shape=(), dtype=float32) tf.Tensor([0. 1. 3. 6.], shape=(4,), dtype=float32)
  """
  del unroll  # XLA decides; the values do not change.
  _function_check(f, "scan", "f")
  xs_leaves, xs_treedef = tree.flatten(xs)
  xs_paths = tree.leaf_paths(xs, "xs")
  xs_leaves = [_to_tensor(leaf, "scan", path)
               for leaf, path in zip(xs_leaves, xs_paths)]
  length = _leading_length(xs_leaves, xs_paths, length)
  start = _Signature(init, "scan", "init")
  step = _Step(f, start, xs_treedef)
  if tf.executing_eagerly() and isinstance(length, int):
    return _scan_eagerly(step, start, xs_leaves, length, reverse)
  return _scan_in_graph(step, start, xs_leaves, length, reverse)


class _Step:
  """One call of a scan's `f`, its results checked as JAX checks them."""

  def __init__(self, f, start, xs_treedef):
    self.f = f
    self.start = start
    self.xs_treedef = xs_treedef
    self.ys = None  # the _Signature of the first y seen

  def __call__(self, carry_leaves, x_leaves):
    out = self.f(self.start.treedef.unflatten(carry_leaves),
                 self.xs_treedef.unflatten(x_leaves))
    if not isinstance(out, (tuple, list)) or len(out) != 2:
      raise TypeError(
          f"tfspmd.lax.scan: f must return a pair (carry, y), as in "
          f"jax.lax.scan, got {type(out).__name__}.")
    carry = _Signature(out[0], "scan", "f's carry")
    self.start.check(carry, "scan", "f must return a carry like init")
    ys = _Signature(out[1], "scan", "f's y")
    if self.ys is None:
      self.ys = ys
    else:
      self.ys.check(ys, "scan", "f must return ys alike at every step")
    return _keeping_shapes(carry.leaves, self.start.leaves), ys.leaves


def _scan_eagerly(step, start, xs_leaves, length, reverse):
  """The scan as a Python loop, as TensorFlow runs its loops eagerly."""
  carry = start.leaves
  ys = [None] * length
  for position in (reversed(range(length)) if reverse else range(length)):
    carry, ys[position] = step(carry, [leaf[position] for leaf in xs_leaves])
  if length:
    stacked = [tf.stack(column) for column in zip(*ys)]
  else:
    _trace_shapes(step, start, xs_leaves)
    stacked = [tf.zeros([0] + y.shape.as_list(), y.dtype)
               for y in step.ys.leaves]
  return (start.treedef.unflatten(carry), step.ys.treedef.unflatten(stacked))


def _trace_shapes(step, start, xs_leaves):
  """Calls `step` in a graph thrown away, for the signature of its ys."""
  with tf_internal.scratch_graph():
    step(start.leaves, [tf.zeros(tf.shape(leaf)[1:], leaf.dtype)
                        for leaf in xs_leaves])


def _scan_in_graph(step, start, xs_leaves, length, reverse):
  """The scan as a `tf.while_loop` over TensorArrays, as `tf.scan` builds it."""
  _trace_shapes(step, start, xs_leaves)
  inputs = [tf.TensorArray(leaf.dtype, size=length,
                           element_shape=leaf.shape[1:]).unstack(leaf)
            for leaf in xs_leaves]
  outputs = [tf.TensorArray(y.dtype, size=length, element_shape=y.shape)
             for y in step.ys.leaves]
  count = len(start.leaves)

  def body(i, *state):
    carry, written = list(state[:count]), state[count:]
    position = length - 1 - i if reverse else i
    carry, ys = step(carry, [array.read(position) for array in inputs])
    written = [array.write(position, y) for array, y in zip(written, ys)]
    return [i + 1] + carry + written

  final = tf.while_loop(
      lambda i, *_: i < length, body,
      [tf.constant(0)] + list(start.leaves) + outputs,
      maximum_iterations=length)
  carry, written = final[1:1 + count], final[1 + count:]
  return (start.treedef.unflatten(list(carry)),
          step.ys.treedef.unflatten([array.stack() for array in written]))


def map(f: Callable[[Any], Any], xs: Any, *,  # pylint: disable=redefined-builtin
        batch_size: int | None = None) -> Any:
  """`f` over the leading axis of `xs`, stacked, as `jax.lax.map`.

  A `scan` with no carry; `batch_size` is taken and changes nothing: the
  values are the same.

  Args:
    f: A function of one slice of `xs`.
    xs: A pytree of tensors sharing a leading axis.
    batch_size: Accepted for JAX's signature.

  Returns:
    What `f` returns, each leaf stacked along a new leading axis.

  Example:
    >>> import tensorflow as tf
    >>> from tfspmd import lax
    >>> print(lax.map(lambda row: tf.reduce_sum(row), tf.ones((3, 2))))
    tf.Tensor([2. 2. 2.], shape=(3,), dtype=float32)
  """
  del batch_size  # the values do not change
  _function_check(f, "map", "f")
  return scan(lambda carry, x: (carry, f(x)), (), xs)[1]


# --- conditionals ------------------------------------------------------------


class _Branches:
  """The branches of a conditional, each called on the operands and checked.

  TensorFlow traces every branch inside a tf.function (eagerly it runs the
  taken one); each traced branch's result is checked against the first's.
  """

  def __init__(self, function, branches, names, operands):
    self.function = function
    self.branches = branches
    self.names = names
    self.operands = operands
    self.first = None

  def branch(self, k):
    def call():
      out = _Signature(self.branches[k](*self.operands), self.function,
                       f"{self.names[k]}'s result")
      if self.first is None:
        self.first = out
      else:
        self.first.check(out, self.function,
                         "every branch must return the same structure, "
                         "dtypes and shapes")
      return out.leaves
    return call

  def rebuild(self, result):
    if not self.first.leaves:
      return self.first.treedef.unflatten([])
    if not isinstance(result, (list, tuple)):
      result = [result]
    return self.first.treedef.unflatten(list(result))


def _scalar(value, function, name, integer):
  if isinstance(value, (bool, int, float, np.bool_, np.number)):
    value = np.asarray(value)
  value = tf.convert_to_tensor(value)
  if value.shape.rank != 0 or not (value.dtype.is_integer or (
      value.dtype == tf.bool and not integer) or (
          value.dtype.is_floating and not integer)):
    kind = "an integer scalar" if integer else "a scalar bool or number"
    raise TypeError(
        f"tfspmd.lax.{function}: {name} must be {kind}, as in "
        f"jax.lax.{function}, got {_describe(value)}.")
  return value


def cond(pred: Any, true_fun: Callable[..., Any], false_fun: Callable[..., Any],
         *operands: Any) -> Any:
  """`true_fun(*operands)` if `pred` else `false_fun(*operands)`, as `jax.lax.cond`.

  A `tf.cond`: inside a pmap `pred` may differ per device, and the branches
  may call collectives. Both branches must return the same tree of the same
  dtypes and shapes, as in JAX.

  Args:
    pred: A scalar bool, or a number (nonzero is True).
    true_fun: The function taken where `pred` holds.
    false_fun: The function taken elsewhere.
    *operands: The branches' arguments, pytrees.

  Returns:
    What the taken branch returns.

  Raises:
    TypeError: If `pred` is not a scalar, or the branches' results differ
      in tree, dtype or shape.

  Example:
    >>> import tensorflow as tf
    >>> from tfspmd import lax
    >>> print(lax.cond(tf.constant(3) > 2, lambda x: x * 10, lambda x: x,
    ...                tf.constant(4)))
    tf.Tensor(40, shape=(), dtype=int32)
  """
  _function_check(true_fun, "cond", "true_fun")
  _function_check(false_fun, "cond", "false_fun")
  pred = _scalar(pred, "cond", "pred", integer=False)
  if pred.dtype != tf.bool:
    pred = tf.not_equal(pred, tf.zeros_like(pred))
  branches = _Branches("cond", [false_fun, true_fun],
                       ["false_fun", "true_fun"], operands)
  result = tf.cond(pred, branches.branch(1), branches.branch(0))
  return branches.rebuild(result)


def switch(index: Any, branches: Sequence[Callable[..., Any]],
           *operands: Any) -> Any:
  """`branches[index](*operands)`, as `jax.lax.switch`.

  `index` is clamped into range, as in JAX (a negative one takes the first
  branch, one past the end the last). A `tf.switch_case`: inside a pmap the
  index may differ per device.

  Args:
    index: An integer scalar.
    branches: A non-empty sequence of functions.
    *operands: The branches' arguments, pytrees.

  Returns:
    What the chosen branch returns.

  Raises:
    TypeError: If `index` is not an integer scalar, or the branches' results
      differ in tree, dtype or shape.
    ValueError: If `branches` is empty.

  Example:
    >>> import tensorflow as tf
    >>> from tfspmd import lax
    >>> fs = [lambda x: x, lambda x: x * 2, lambda x: x * 3]
    >>> print([int(lax.switch(i, fs, 5)) for i in (-1, 1, 7)])
    [5, 10, 15]
  """
  branches = list(branches) if isinstance(branches, Sequence) else branches
  if not isinstance(branches, list) or not branches:
    raise ValueError(
        f"tfspmd.lax.switch: branches must be a non-empty sequence of "
        f"functions, as in jax.lax.switch, got {branches!r}.")
  for k, branch in enumerate(branches):
    _function_check(branch, "switch", f"branches[{k}]")
  index = _scalar(index, "switch", "index", integer=True)
  index = tf.clip_by_value(tf.cast(index, tf.int32), 0, len(branches) - 1)
  calls = _Branches("switch", branches,
                    [f"branches[{k}]" for k in range(len(branches))], operands)
  result = tf.switch_case(
      index, [calls.branch(k) for k in range(len(branches))])
  return calls.rebuild(result)
