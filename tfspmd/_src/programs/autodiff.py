"""`jax.grad` and `jax.value_and_grad` over `tf.GradientTape`.

The arguments named by `argnums` are pytrees; each leaf is watched by a tape
while the function runs, and the gradient comes back in the argument's tree.
The tape works eagerly, inside a `tf.function` and inside a pmapped function
(where each device takes the gradient of its own value, as `jax.grad` inside
`jax.pmap` does).
"""

from collections.abc import Callable
from collections.abc import Sequence
import functools
from typing import Any

import tensorflow as tf

from tfspmd._src.trees import tree


def _argnums(argnums, name):
  if isinstance(argnums, int) and not isinstance(argnums, bool):
    return (argnums,), False
  if isinstance(argnums, Sequence) and argnums and all(
      isinstance(k, int) and not isinstance(k, bool) for k in argnums):
    return tuple(argnums), True
  raise TypeError(
      f"tfspmd.{name}: argnums must be an int or a non-empty tuple "
      f"of ints, as in jax.grad, got {argnums!r}.")


def _watched(value, root, name):
  """`value`'s leaves as tensors (variables kept) and its treedef."""
  leaves, treedef = tree.flatten(value)
  paths = tree.leaf_paths(value, root)
  out = []
  for leaf, path in zip(leaves, paths):
    if not isinstance(leaf, tf.Variable):
      try:
        leaf = tf.convert_to_tensor(leaf)
      except (TypeError, ValueError):
        raise TypeError(
            f"tfspmd.{name}: {path} is {type(leaf).__name__} {leaf!r}, which "
            f"cannot be differentiated; pass it through another argument "
            f"than argnums names.") from None
    if not (leaf.dtype.is_floating or leaf.dtype.is_complex):
      raise TypeError(
          f"tfspmd.{name}: {path} has dtype {leaf.dtype.name}; gradients are "
          f"taken with respect to floating-point leaves only, as in jax.grad. "
          f"Cast it (tf.cast(x, tf.float32)) or pass it through another "
          f"argument than argnums names.")
    out.append(leaf)
  return out, treedef


def _scalar_value(value, has_aux, name):
  if has_aux:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
      raise TypeError(
          f"tfspmd.{name}: with has_aux=True the function must return "
          f"a pair (value, aux), as in jax.grad, got {type(value).__name__}.")
    value, aux = value
  else:
    aux = None
  if isinstance(value, (tuple, list, dict)):
    raise TypeError(
        f"tfspmd.{name}: the function must return a scalar, as in "
        f"jax.grad, got a {type(value).__name__}; with an auxiliary result, "
        f"pass has_aux=True and return (value, aux).")
  value = tf.convert_to_tensor(value)
  if value.shape.rank != 0 or not value.dtype.is_floating:
    raise TypeError(
        f"tfspmd.{name}: the function must return a floating-point "
        f"scalar, as in jax.grad, got {value.dtype.name}"
        f"{value.shape.as_list()}; reduce it first (tf.reduce_sum or "
        f"tf.reduce_mean).")
  return value, aux


def value_and_grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0,
                   has_aux: bool = False) -> Callable[..., Any]:
  """`fun` and its gradient, as `jax.value_and_grad`.

  Args:
    fun: A function returning a floating-point scalar (or `(scalar, aux)`
      with `has_aux`).
    argnums: The position of the argument to differentiate, or a tuple of
      positions; each argument is a pytree of floating-point leaves.
    has_aux: Whether `fun` returns `(value, aux)`; aux is returned as it is.

  Returns:
    A function of `fun`'s arguments returning `(value, grads)`, or
    `((value, aux), grads)` with `has_aux`. `grads` has the tree of the
    argument (a tuple of them for a tuple `argnums`); a leaf `fun` does not
    use gets zeros, as in JAX.

  Raises:
    TypeError: If `argnums` is not an int or a tuple of ints, a leaf to
      differentiate is not floating-point, or `fun` does not return a
      floating-point scalar (a pair with `has_aux`).

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> loss = lambda p, x: tf.reduce_sum((p['w'] * x + p['b']) ** 2)
    >>> value, grads = tfspmd.value_and_grad(loss)(
    ...     {'w': tf.constant(2.), 'b': tf.constant(1.)}, tf.constant([1., 2.]))
    >>> print(value, grads['w'], grads['b'])
    tf.Tensor(34.0, shape=(), dtype=float32) tf.Tensor(26.0, shape=(), dtype=float32) tf.Tensor(16.0, shape=(), dtype=float32)
  """
  return _value_and_grad(fun, argnums, has_aux, "value_and_grad")


def _value_and_grad(fun, argnums, has_aux, name):
  """`value_and_grad`, its messages naming the public function `name`."""
  if not callable(fun):
    raise TypeError(
        f"tfspmd.{name}: fun must be a function, got "
        f"{type(fun).__name__} {fun!r}.")
  positions, as_tuple = _argnums(argnums, name)

  @functools.wraps(fun)
  def value_and_grad_fun(*args, **kwargs):
    for k in positions:
      if not -len(args) <= k < len(args):
        raise TypeError(
            f"tfspmd.{name}: argnums names argument {k}, but the "
            f"function was called with {len(args)} positional arguments; "
            f"pass the arguments to differentiate by position, as jax.grad "
            f"takes them.")
    args = list(args)
    watched = []
    for k in positions:
      leaves, treedef = _watched(args[k], f"args[{k}]", name)
      watched.append((leaves, treedef))
      args[k] = treedef.unflatten(leaves)
    with tf.GradientTape(watch_accessed_variables=False) as tape:
      for leaves, _ in watched:
        tape.watch(leaves)
      value, aux = _scalar_value(fun(*args, **kwargs), has_aux, name)
    grads = tape.gradient(
        value, [leaves for leaves, _ in watched],
        unconnected_gradients=tf.UnconnectedGradients.ZERO)
    trees = tuple(
        treedef.unflatten([tf.convert_to_tensor(g) for g in leaf_grads])
        for (_, treedef), leaf_grads in zip(watched, grads))
    grads = trees if as_tuple else trees[0]
    return ((value, aux), grads) if has_aux else (value, grads)

  return value_and_grad_fun


def grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0,
         has_aux: bool = False) -> Callable[..., Any]:
  """The gradient of `fun`, as `jax.grad`.

  Args:
    fun: A function returning a floating-point scalar (or `(scalar, aux)`
      with `has_aux`).
    argnums: The position of the argument to differentiate, or a tuple of
      positions; each argument is a pytree of floating-point leaves.
    has_aux: Whether `fun` returns `(value, aux)`.

  Returns:
    A function of `fun`'s arguments returning the gradient in the tree of
    the argument (a tuple of them for a tuple `argnums`), or `(grads, aux)`
    with `has_aux`.

  Raises:
    TypeError: As `value_and_grad`.

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> print(tfspmd.grad(lambda x: tf.reduce_sum(x ** 3))(tf.constant([1., 2.])))
    tf.Tensor([ 3. 12.], shape=(2,), dtype=float32)

    Inside a pmap each device takes the gradient of its own value:

    >>> step = tfspmd.pmap(lambda w, x: tfspmd.lax.pmean(
    ...     tfspmd.grad(lambda w: tf.reduce_sum(w * x))(w), 'i'), 'i')
    >>> print(step(tf.ones((4, 2)), tf.reshape(tf.range(8.), (4, 2))))
    [[3. 4.]
     [3. 4.]
     [3. 4.]
     [3. 4.]]
  """
  with_value = _value_and_grad(fun, argnums, has_aux, "grad")

  @functools.wraps(fun)
  def grad_fun(*args, **kwargs):
    if has_aux:
      (_, aux), grads = with_value(*args, **kwargs)
      return grads, aux
    return with_value(*args, **kwargs)[1]

  return grad_fun
