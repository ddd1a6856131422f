"""On the host executor, an integer division by zero gives JAX's numbers.

TensorFlow's integer kernels fail on a zero divisor, and DTensor's executor
raises that failure. XLA's, which run the host executor's program, do not:
like `jax.pmap` it computes a number, but TensorFlow's lowering of
`FloorDiv` and `FloorMod` gives other numbers than `jnp.floor_divide` and
`jnp.remainder` at a zero divisor (`7 // 0` is -1, JAX's -2; `7 % 0` is 7,
JAX's 0). On the host executor those two ops get the inputs that give JAX's
results: a divisor of 1 where it is 0, and for `FloorDiv` a dividend of -1
where it is 0 (JAX's `0 // 0`) and -2 elsewhere, or of the unsigned dtype's
largest value, which TensorFlow's kernels compute too where the program
runs op by op (`jit_compile=False`). Truncating divisions
(`tf.truncatediv`, `tf.truncatemod`) already give JAX's numbers under XLA
(`lax.div`, `lax.rem`; op by op they raise tfspmd's error); an integer to a
negative power gives XLA's (0, or 1 and -1 for a base of 1 and -1), as
`jax.lax` does, where `jnp.power` reads only the exponent's low bits.
"""

import tensorflow as tf

from tfspmd._src.core import tf_internal
from tfspmd._src.core import trace_context

_do_not_convert = tf.autograph.experimental.do_not_convert

TYPES = frozenset({"FloorDiv", "FloorMod"})


def follow_jax(operation):
  """Gives `operation`, on the host executor, JAX's result at a zero divisor.

  Wraps the converter `operation` was given (`converters`), in a program
  traced for the host executor only.
  """
  trace = trace_context.this_thread.trace
  dtype = operation.outputs[0].dtype if operation.outputs else tf.string
  if (operation.type not in TYPES or trace is None or not trace.host or
      not dtype.is_integer):
    return
  converter = tf_internal.converter_of(operation)
  if converter is None:
    return
  floor_div = operation.type == "FloorDiv"

  @_do_not_convert
  def convert(op_inputs):
    x, y = op_inputs.inputs()[:2]
    rank = max(x.tensor.shape.rank - x.stacked, y.tensor.shape.rank - y.stacked)
    x = _aligned(x, rank, op_inputs.loop_size)
    y = _aligned(y, rank, op_inputs.loop_size)
    by_zero = tf.equal(y, 0)
    if floor_div and dtype.is_unsigned:
      x = tf.where(by_zero, tf.constant(dtype.max, dtype), x)
    elif floor_div:
      x = tf.where(by_zero, tf.where(tf.equal(x, 0), -tf.ones_like(x),
                                     -2 * tf.ones_like(x)), x)
    y = tf.where(by_zero, tf.ones_like(y), y)
    return converter(tf_internal.with_inputs(op_inputs, [
        tf_internal.ConvertedValue(x, True),
        tf_internal.ConvertedValue(y, True)]))

  tf_internal.set_pfor_converter(operation, convert)


def _aligned(value, rank, size):
  """`value` stacked, with size-1 dimensions after the loop's up to `rank`.

  Two inputs so aligned broadcast against each other as the per-device
  values do.
  """
  tensor = tf_internal.stacked(value, size)
  shape = tf.shape(tensor)
  ones = tf.ones([rank - (tensor.shape.rank - 1)], tf.int32)
  return tf.reshape(tensor, tf.concat([shape[:1], ones, shape[1:]], 0))
