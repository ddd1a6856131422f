"""Stateless random ops with a different seed on each device.

TensorFlow has no batched stateless random op: pfor vectorizes one whose
seed (or key, counter, or distribution parameter) differs between
positions with a `tf.while_loop` over the positions, which DTensor cannot
place (TF 2.21). The converter here makes one op per position instead,
each with that position's seed, and stacks their results: every device
then draws exactly the numbers the same op draws eagerly with its own
seed (as debug mode does), at the cost of each device drawing the numbers
of every position, not only its own.
"""

import tensorflow as tf

from tfspmd._src import tf_internal

_do_not_convert = tf.autograph.experimental.do_not_convert

_SEEDED = frozenset({
    "StatelessMultinomial",
    "StatelessParameterizedTruncatedNormal",
    "StatelessRandomBinomial",
    "StatelessRandomGammaV2",
    "StatelessRandomGammaV3",
    "StatelessRandomGetKeyCounter",
    "StatelessRandomGetKeyCounterAlg",
    "StatelessRandomNormal",
    "StatelessRandomNormalV2",
    "StatelessRandomPoisson",
    "StatelessRandomUniform",
    "StatelessRandomUniformFullInt",
    "StatelessRandomUniformFullIntV2",
    "StatelessRandomUniformInt",
    "StatelessRandomUniformIntV2",
    "StatelessRandomUniformV2",
    "StatelessShuffle",
    "StatelessTruncatedNormal",
    "StatelessTruncatedNormalV2",
})


def mark(operations):
  """Gives the seeded random ops among `operations` the per-position converter."""
  for operation in operations:
    if operation.type in _SEEDED:
      tf_internal.set_pfor_converter(operation, _convert_per_position)


@_do_not_convert
def _convert_per_position(pfor_input):
  size = tf_internal.pfor_loop_size(pfor_input)
  values = tf_internal.pfor_inputs(pfor_input)
  per_position = []
  for k in range(size):
    inputs = [tf.gather(v.tensor, k) if v.stacked else v.tensor
              for v in values]
    per_position.append(tf_internal.recreate_op(pfor_input.op, inputs))
  return [tf_internal.wrap_converted(_stack(outputs), True)
          for outputs in zip(*per_position)]


def _stack(values):
  """`tf.stack(values)` in ops DTensor expands right.

  DTensor's expansion of Pack (TF 2.21) with replicated inputs and an
  output split along the new axis keeps every row on every device (the
  program then fails its layout check), and it refuses a Concat along a
  split axis. A sum of each value placed in its own row by a one-hot mask
  expands right.
  """
  count = len(values)
  dtype = values[0].dtype
  exact = dtype if dtype.is_floating else tf.int64
  total = None
  for k, value in enumerate(values):
    row = tf.reshape(tf.one_hot(k, count, dtype=exact),
                     [count] + [1] * value.shape.rank)
    term = row * tf.expand_dims(tf.cast(value, exact), 0)
    total = term if total is None else total + term
  return tf.cast(total, dtype)
