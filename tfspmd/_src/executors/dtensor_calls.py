"""Calling a program DTensor lowers, and lowering it again under a new name.

DTensor (TF 2.21) names the functions it outlines from a program's loops
and branches (`while5_body`) after their ops, with a counter it shares
with every program it lowered before, and remembers each name by the
address of the op it gave it to: an op made later where a named one was
freed gets that old name. The function goes into the process's one
function library, which refuses a second function of that name. A
program lowered again, its ops kept off the freed addresses
(`heap_blocks`), gets new names: glibc's allocator hands out the
address just freed, so without the blocks held the retry meets the same
name again. The host executor lowers nothing through DTensor and needs
none of this.
"""

import contextlib
import re

import tensorflow as tf

from tfspmd._src.core import tf_internal
from tfspmd._src.executors import heap_blocks

_NAME_TAKEN = re.compile(r"Cannot add function '[^']*' because a different "
                         r"function with the same name already exists")
RELOWERINGS = 7
_NOTHING_HELD = contextlib.nullcontext()


def name_taken(error):
  """Whether `error` says DTensor made a function of a name already taken."""
  return bool(_NAME_TAKEN.search(str(error)))


def flat_caller(concrete_function, captured):
  """A fast way to call a ConcreteFunction with its inputs as a flat list.

  `ConcreteFunction.__call__` re-binds its arguments against the Python
  signature on every call; the pmap's cache key already guarantees they fit.
  `captured` stands for the function's captured inputs, in their order.

  The function runs without grappler, TensorFlow's graph optimizer: DTensor
  expands a program into one copy of each op per device, and grappler's
  passes over that copy dominated a program's first call and the call that
  expands it again for inputs from another program (the README's
  performance notes have a conv-net step's times), while its steady calls
  took the same time with or without them.

  DTensor may give a function it makes of a loop or a branch a name that an
  earlier program's function already has (`name_taken`): such a call is
  made again through a function of a new name, which DTensor lowers anew.
  """
  options = tf_internal.options_without_grappler()
  # `(call_flat, captured)` of the function called, None until renamed after
  # DTensor met a name already taken.
  target = [(tf_internal.flat_call(concrete_function), captured)]

  def call(*tensors):
    with tf_internal.CallOptions(options):
      for attempt in range(RELOWERINGS + 1):
        if target[0] is None:
          target[0] = renamed(concrete_function, captured)
        call_flat, inputs = target[0]
        try:
          with heap_blocks.freed_blocks_held() if attempt else _NOTHING_HELD:
            return call_flat(list(tensors), inputs)
        except tf.errors.InvalidArgumentError as e:
          if not name_taken(e):
            raise
          # DTensor keeps what it made of a function that failed to lower:
          # the next try, now or at a later call, goes through a new one.
          target[0] = None
          if attempt == RELOWERINGS:
            raise

  return call


def renamed(concrete_function, captured):
  """`(call_flat, captured)` of a new function that calls `concrete_function`.

  DTensor lowers a function once per name and input signature; one of a new
  name is lowered from the start, its loops given names not yet handed out.
  """
  arguments = concrete_function.inputs[:len(concrete_function.inputs) -
                                       len(captured)]
  specs = [tf.TensorSpec(t.shape, t.dtype) for t in arguments]
  call_inner = tf_internal.flat_call(concrete_function)
  calling = tf.function(
      lambda *tensors: call_inner(list(tensors), captured),
      jit_compile=True, autograph=False).get_concrete_function(*specs)
  return tf_internal.flat_call(calling), calling.captured_inputs
