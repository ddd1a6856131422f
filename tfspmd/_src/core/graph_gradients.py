"""Custom gradients of traced ops that live as long as the op they belong to.

`tf.custom_gradient` in a traced function registers each gradient in
TensorFlow's process-wide gradient registry under a name of its own and
never removes it (TF 2.21). The gradient's closure holds the graph it was
traced in, so every program traced with a collective kept its per-device
graph for the rest of the process, used or dropped. Here one gradient is
registered once, and it calls the gradient kept on the op itself, which
goes with the op's graph.
"""

import functools

import tensorflow as tf

from tfspmd._src.core import tf_internal

_GRADIENT_NAME = "TfspmdGradientOfItsOp"
_GRADIENT_ATTRIBUTE = "tfspmd_gradient"


@tf.RegisterGradient(_GRADIENT_NAME)
def _gradient_kept_on_the_op(op, *output_gradients):
  gradient = getattr(op, _GRADIENT_ATTRIBUTE, None)
  if gradient is None:
    # A SavedModel traces the gradient of each op it saves with no op at
    # all, and pfor copies an op that does not vary between devices without
    # its Python attributes: neither has the transpose, which only a pmap's
    # trace can build. Saving goes on; differentiating such a copy fails.
    return [_unavailable(value) for value in output_gradients]
  return gradient(*output_gradients)


def _unavailable(like):
  """A tensor like `like` whose computation fails, saying why."""
  check = tf.debugging.Assert(False, [
      "the gradient of a tfspmd collective whose value is the same on every "
      "device, or of one in a SavedModel, is not available here: take "
      "gradients inside the mapped function, or of the pmap call before "
      "saving"])
  with tf.control_dependencies([check]):
    return tf.zeros_like(like)


def custom_gradient(f):
  """`tf.custom_gradient` whose gradient the traced op holds, not TensorFlow.

  For functions of tensors that read no variable (a collective and its
  transpose). Eagerly it is `tf.custom_gradient` itself, which keeps
  nothing.

  Args:
    f: `f(*tensors) -> (result, gradient)`, as for `tf.custom_gradient`:
      `result` a tensor or a nest of them, `gradient(*result_cotangents)`
      the cotangent of each argument (None for none).

  Returns:
    `f` made differentiable by a GradientTape and by `tf.gradients` with
    its own gradient.

  Example:
    >>> import tensorflow as tf
    >>> from tfspmd._src.core import graph_gradients
    >>> @graph_gradients.custom_gradient
    ... def clipped_gradient(x):
    ...   return tf.identity(x), lambda dy: tf.clip_by_value(dy, -1.0, 1.0)
    >>> @tf.function
    ... def slope(x):
    ...   with tf.GradientTape() as tape:
    ...     tape.watch(x)
    ...     y = clipped_gradient(x) * 5.0
    ...   return tape.gradient(y, x)
    >>> float(slope(tf.constant(2.0)))
    1.0
  """
  eager = tf.custom_gradient(f)

  @functools.wraps(f)
  def traced(*args):
    if tf.executing_eagerly():
      return eager(*args)
    args = [tf.convert_to_tensor(arg) for arg in args]
    result, gradient = f(*args)
    results = tf.nest.flatten(result)
    count = len(results)

    def gradients_of_inputs(*output_gradients):
      # IdentityN passes results and arguments through: the results' own
      # inputs get no gradient, the arguments get `gradient`'s.
      argument_gradients = gradient(*output_gradients[:count])
      return [None] * count + tf.nest.flatten(argument_gradients)

    graph = tf.compat.v1.get_default_graph()
    with graph.gradient_override_map({"IdentityN": _GRADIENT_NAME}):
      outputs = tf.raw_ops.IdentityN(input=results + args)
    setattr(outputs[0].op, _GRADIENT_ATTRIBUTE, gradients_of_inputs)
    tf_internal.record_backward(f.__name__, outputs, results + args,
                                gradients_of_inputs)
    return tf.nest.pack_sequence_as(result, outputs[:count])

  return traced
