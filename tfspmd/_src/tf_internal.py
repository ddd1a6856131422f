"""Every private TensorFlow name tfspmd uses, in one place.

tfspmd vectorizes the per-device program with pfor, TensorFlow's private
vectorizer, and gives its collectives their own pfor converters through the
`pfor_converter` attribute of an `Operation` (checked by pfor before its
registry). Both are private APIs: a TensorFlow upgrade may move them, so they
are imported only here and checked once, at import, against the versions the
test suite runs on.
"""

import re

import tensorflow as tf

SUPPORTED_TF_VERSIONS = ("2.21",)

try:
  from tensorflow.dtensor.python import accelerator_util as _accelerator_util
  from tensorflow.python.eager import context as _context
  from tensorflow.python.eager import record as _record
  from tensorflow.python.ops.parallel_for import control_flow_ops as _pfor_ops
  from tensorflow.python.ops.parallel_for import pfor as _pfor
except ImportError as e:  # pragma: no cover - depends on the installed TF.
  raise ImportError(
      f"tfspmd needs TensorFlow's parallel_for internals, which TensorFlow "
      f"{tf.__version__} does not have ({e}). tfspmd is tested with TensorFlow "
      f"{', '.join(SUPPORTED_TF_VERSIONS)}.") from e


def _check_pfor_hooks():
  """Fails at import, naming the TF version, if a pfor hook tfspmd needs moved."""
  import inspect  # pylint: disable=import-outside-toplevel
  missing = [name for name in ("_pfor_impl",) if not hasattr(_pfor_ops, name)]
  missing += [name for name in ("wrap", "PFor") if not hasattr(_pfor, name)]
  source = inspect.getsource(_pfor.PFor)
  if '"pfor_converter"' not in source:
    missing.append("PFor's per-op `pfor_converter` hook")
  if missing:
    raise ImportError(
        f"TensorFlow {tf.__version__} lacks pieces of its private pfor API that "
        f"tfspmd relies on: {', '.join(missing)}. tfspmd is tested with "
        f"TensorFlow {', '.join(SUPPORTED_TF_VERSIONS)}; install one of those.")


_check_pfor_hooks()


def vectorize_loop(loop_fn, iterations):
  """Runs pfor's conversion of `loop_fn(i)` in the graph being traced.

  `tf.vectorized_map` wraps the loop in a nested `tf.function` under XLA; the
  caller here is always already tracing one, so the loop is converted in
  place and no function call is left in the program.
  """
  return _pfor_ops._pfor_impl(  # pylint: disable=protected-access
      loop_fn, iterations, fallback_to_while_loop=False)


def unvectorizable_op(error):
  """What pfor could not vectorize, from its error: (op type, input name).

  The input name is set when the op has a converter that needs that input
  to be the same on every iteration; None when the op has no converter at
  all. Returns None for other errors.
  """
  message = str(error)
  prefix = "No pfor vectorization defined for "
  if message.startswith(prefix):
    return message[len(prefix):].split()[0].strip("."), None
  found = _LOOP_INVARIANT_INPUT.search(message)
  if found:
    return found.group(2), found.group(1)
  return None


_LOOP_INVARIANT_INPUT = re.compile(
    r"""Input "(\w+)" of op '(\w+)' expected to be loop invariant""")


def wrap_converted(tensor, stacked):
  """The value a pfor converter returns for one output."""
  return _pfor.wrap(tensor, stacked)


def default_pfor_converter(op_type):
  """pfor's own converter for ops of `op_type`."""
  return _pfor._pfor_converter_registry[op_type]  # pylint: disable=protected-access


def set_pfor_converter(operation, converter):
  """Makes pfor call `converter(pfor_input)` for `operation`."""
  operation.pfor_converter = converter


def wait_for_pending_ops():
  """Blocks until every op dispatched in eager mode has finished."""
  _context.async_wait()


def devices_initialized():
  """True once TensorFlow has created its logical devices."""
  return _context.context()._initialized  # pylint: disable=protected-access


def accelerator_system_initialized():
  """True once DTensor's accelerator system is up (tfspmd's or the user's)."""
  return _accelerator_util.is_initialized()


def configure_coordination_service(leader, register_timeout_s,
                                   heartbeat_timeout_s, shutdown_timeout_s):
  """Sets up the coordination service a multi-process runtime starts with.

  `register_timeout_s` bounds the wait for every process to join: with
  `cluster_register_with_barrier`, joining is one barrier under that timeout
  whose error names the processes missing. Without it, process 0 waits for
  its peers in TensorFlow's device-exchange barrier, whose timeout is fixed
  at one hour (`kDevicePropagationTimeout`, TF 2.21).
  """
  context = _context.context()
  context.configure_coordination_service(
      service_type="standalone", service_leader=leader,
      cluster_register_timeout_in_ms=int(register_timeout_s * 1000),
      heartbeat_timeout_in_ms=int(heartbeat_timeout_s * 1000),
      shutdown_barrier_timeout_in_ms=int(shutdown_timeout_s * 1000))
  context.coordination_service.cluster_register_with_barrier = True


def flat_caller(concrete_function):
  """A fast way to call a ConcreteFunction with its inputs as a flat list.

  `ConcreteFunction.__call__` re-binds its arguments against the Python
  signature on every call; the pmap's cache key already guarantees they fit.
  """
  captured = concrete_function.captured_inputs
  call_flat = concrete_function._call_flat  # pylint: disable=protected-access

  def call(*tensors):
    return call_flat(list(tensors), captured)

  return call


def tape_may_record(tensors):
  """True if an active GradientTape records operations on `tensors`."""
  return _record.could_possibly_record() and bool(
      _record.should_record_backprop(tensors))


def tape_active():
  """True if any GradientTape is recording."""
  return _record.could_possibly_record()
