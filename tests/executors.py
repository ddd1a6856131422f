"""What the executor the tests run under computes differently, for references.

The host executor compiles a program with XLA, whose stateless random ops
draw other numbers than TensorFlow's kernels for the same seed (as
`tf.function(jit_compile=True)` does), and whose gathers clamp an index
out of range as JAX's do. A reference computed one device at a time follows
the executor through `as_the_program_runs`.
"""

import tensorflow as tf


def on_host():
  """Whether tfspmd's programs run on the host executor in this process."""
  import tfspmd  # pylint: disable=import-outside-toplevel
  return tfspmd.config.tfspmd_executor in ("auto", "host")


def as_the_program_runs(function):
  """`function` compiled by XLA where the programs are, as it is elsewhere."""
  if on_host():
    return tf.function(function, jit_compile=True, autograph=False)
  return function

