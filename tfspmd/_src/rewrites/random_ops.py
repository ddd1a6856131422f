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

from tfspmd._src.core import tf_internal
from tfspmd._src.rewrites import per_position

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
      tf_internal.set_pfor_converter(operation, per_position.convert)
