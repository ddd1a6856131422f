"""TensorFlow op types that more than one layer of tfspmd looks for.

Example:
  >>> "StatelessWhile" in LOOPS
  True
"""

# The loop ops: `tf.while_loop`, `tf.scan`, `tf.range` loops in a graph.
LOOPS = ("While", "StatelessWhile")
