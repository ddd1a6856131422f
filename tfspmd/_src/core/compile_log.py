"""What tfspmd traces and compiles, told as JAX's `jax_log_compiles` tells it.

With `tfspmd.config.update('tfspmd_log_compiles', True)` (JAX's name
`jax_log_compiles` too), each trace of a mapped function and each first run
of a program (DTensor's SPMD lowering and the compile) logs one line on the
`tfspmd` logger at WARNING, as JAX logs compiles, so that it shows without
setting up logging: what was traced, for which arguments, and how long it
took. Whatever the setting, a function traced for the fifth signature
warns once, as `tf.function` warns of retracing: every new shape, dtype or
static argument traces and compiles the program again.
"""

import contextlib
import logging
import threading
import weakref

from tfspmd._src.core.config import config

logger = logging.getLogger("tfspmd")
# Traces of one function after which it warns, once (tf.function's count).
RETRACES_WARNED_AT = 5

_lock = threading.Lock()
_traces = weakref.WeakKeyDictionary()  # a function's program cache -> traces


_shown = threading.local()


@contextlib.contextmanager
def arguments_shown_as(signature):
  """Within it, traces and compiles are logged for `signature`.

  A shard_map runs its function as nested pmaps of each device's block: its
  log lines name the global arrays the user passed, not those blocks.
  """
  previous = getattr(_shown, "signature", None)
  _shown.signature = signature
  try:
    yield
  finally:
    _shown.signature = previous


def _as_shown(signature):
  shown = getattr(_shown, "signature", None)
  return signature if shown is None else shown


def describe_arguments(signature):
  """'float32[8,3], int32[]' for `((shape, dtype), ...)`."""
  return ", ".join(f"{dtype.name}[{','.join(map(str, shape))}]"
                   for shape, dtype in signature)


def traced(owner, name, signature, seconds):
  """Records a trace of the function `name` (whose programs are `owner`).

  Args:
    owner: The function's program cache: its traces are counted on it.
    name: The function, as the messages name it ('pmap of step').
    signature: `((shape, dtype), ...)` of the arguments it was traced for.
    seconds: How long the trace took.
  """
  with _lock:
    count = _traces.get(owner, 0) + 1
    _traces[owner] = count
  if config.tfspmd_log_compiles:
    logger.warning("tfspmd: traced %s for (%s) in %.3f s", name,
                   describe_arguments(_as_shown(signature)), seconds)
  if count == RETRACES_WARNED_AT:
    logger.warning(
        "tfspmd: %s was traced for %d different call signatures (the last: "
        "%s). Each new shape, dtype, tree structure or static argument "
        "traces it again, and its program is lowered and compiled again at "
        "its first call. Pass arrays of a few fixed shapes (pad the last "
        "batch), and keep static arguments and Python numbers that change "
        "out of the arguments (pass them as arrays).", name, count,
        describe_arguments(_as_shown(signature)))


def compiled(name, signature, seconds, by_xla=True):
  """Records a program's first run: its lowering, compile and run.

  `by_xla` False: the program ran through TensorFlow's kernels op by op
  (a pmap's `jit_compile=False`, or a program XLA refused).
  """
  if config.tfspmd_log_compiles:
    logger.warning(
        "tfspmd: %s %s for (%s) in %.3f s",
        "lowered, compiled and ran" if by_xla else
        "ran op by op, without XLA,", name,
        describe_arguments(_as_shown(signature)), seconds)
