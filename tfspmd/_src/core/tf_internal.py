"""Every private TensorFlow name tfspmd uses, in one place.

tfspmd vectorizes the per-device program with pfor, TensorFlow's private
vectorizer, and gives its collectives their own pfor converters through the
`pfor_converter` attribute of an `Operation` (checked by pfor before its
registry). Both are private APIs: a TensorFlow upgrade may move them, so they
are imported only here and checked once, at import, against the versions the
test suite runs on.
"""

import contextlib
import functools
import logging
import re
import threading

import tensorflow as tf

from tfspmd._src.core import op_types

SUPPORTED_TF_VERSIONS = ("2.21",)

try:
  from tensorflow.dtensor.python import accelerator_util as _accelerator_util
  from tensorflow.dtensor.python import api as _dtensor_api
  from tensorflow.core.function.polymorphism import function_type as _function_type
  from tensorflow.python import _pywrap_dtensor_device
  from tensorflow.python.eager import context as _context
  from tensorflow.python.eager import execute as _execute
  from tensorflow.python.eager import record as _record
  from tensorflow.python.eager.polymorphic_function import concrete_function as _concrete_function
  from tensorflow.python.eager.polymorphic_function import transform as _function_transform
  from tensorflow.python.framework import errors_impl as _errors_impl
  from tensorflow.core.lib.core import error_codes_pb2 as _error_codes
  from tensorflow.core.protobuf import config_pb2 as _config_pb2
  from tensorflow.python.framework import func_graph as _func_graph
  from tensorflow.python.framework import op_callbacks as _op_callbacks
  from tensorflow.python.ops import control_flow_util_v2 as _control_flow_util
  from tensorflow.python.ops import gen_resource_variable_ops as _gen_variables
  from tensorflow.python.ops import gen_state_ops as _gen_state
  from tensorflow.python.ops import gen_training_ops as _gen_training
  from tensorflow.python.ops import while_v2 as _while_v2
  from tensorflow.python.ops.parallel_for import pfor as _pfor
  from tensorflow.python.trackable import data_structures as _data_structures
except ImportError as e:  # pragma: no cover - depends on the installed TF.
  raise ImportError(
      f"tfspmd needs TensorFlow's parallel_for internals, which TensorFlow "
      f"{tf.__version__} does not have ({e}). tfspmd is tested with TensorFlow "
      f"{', '.join(SUPPORTED_TF_VERSIONS)}.") from e


def _check_pfor_hooks():
  """Fails at import, naming the TF version, if a pfor hook tfspmd needs moved."""
  missing = [name for name in ("wrap", "PFor", "_PforInput", "_stack",
                               "_create_op", "_pfor_converter_registry")
             if not hasattr(_pfor, name)]
  if not hasattr(_while_v2, "_WhileBodyGradFuncGraph"):
    missing.append("while_v2._WhileBodyGradFuncGraph")
  # The module's text, not `inspect.getsource(PFor)`, which parses all of
  # it into a syntax tree at every import.
  with open(_pfor.__file__, encoding="utf-8") as f:
    source = f.read()
  if '"pfor_converter"' not in source:
    missing.append("PFor's per-op `pfor_converter` hook")
  if missing:
    raise ImportError(
        f"TensorFlow {tf.__version__} lacks pieces of its private pfor API that "
        f"tfspmd relies on: {', '.join(missing)}. tfspmd is tested with "
        f"TensorFlow {', '.join(SUPPORTED_TF_VERSIONS)}; install one of those.")


_check_pfor_hooks()


def vectorize_loop(loop_fn, iterations, prepare):
  """pfor's conversion of `loop_fn(i)` into the graph being traced.

  `tf.vectorized_map` traces `loop_fn` into the caller's graph, where its
  per-position ops stay behind, dead, beside their conversion, with every
  function they call (a loop body, a `tf.function`). DTensor lays out the
  functions of a program even when nothing calls them, and fails on many
  (TF 2.21). So `loop_fn` is traced in a graph of its own, and only its
  vectorized form enters the caller's graph. `prepare` is as for
  `convert_graph_inline`.
  """
  per_position = _func_graph.FuncGraph("tfspmd_per_device")
  with per_position.as_default():
    loop_var = tf.compat.v1.placeholder_with_default(0, shape=[])
    outputs = [tf.convert_to_tensor(t) for t in loop_fn(loop_var)]
  caller = tf.compat.v1.get_default_graph()
  first_op = len(caller.get_operations())
  conversion = Conversion(_pfor.PFor(
      loop_var, iterations, per_position.get_operations(),
      fallback_to_while_loop=False), iterations)
  for external, internal in per_position.captures:
    conversion.define(internal, ConvertedValue(external, False))
  prepare(conversion, per_position.get_operations())
  with _quiet_conversion_errors():
    results = [stacked(conversion.convert(t), iterations) for t in outputs]
  converted = caller.get_operations()[first_op:]
  _copy_called_functions(converted, per_position, caller)
  _forget_original_ops(converted)
  return results


class _ConversionErrorFilter(logging.Filter):
  """Drops pfor's log of a failed conversion (the op's NodeDef, its stack).

  tfspmd turns every such failure into one error of its own; pfor's log
  would print TensorFlow's internals before it.
  """

  def filter(self, record):
    message = str(record.msg)
    return not (message.startswith("Got error while pfor was converting op")
                or message == "%s\ncreated at:\n  %s")


@contextlib.contextmanager
def _quiet_conversion_errors():
  log = logging.getLogger("tensorflow")
  quiet = _ConversionErrorFilter()
  log.addFilter(quiet)
  try:
    yield
  finally:
    log.removeFilter(quiet)


def _forget_original_ops(operations):
  """Drops each converted op's link to the per-position op it came from.

  pfor keeps it (`_original_op`) only for its log of a conversion that
  fails; once the conversion is done it would hold the per-position graph
  for as long as the caller's graph lives. The ops of the functions the
  converted ops call (loop bodies, branches) are converted ops too.
  """
  seen = set()
  pending = list(operations)
  while pending:
    operation = pending.pop()
    operation._original_op = None  # pylint: disable=protected-access
    for name in _called_function_names(operation):
      found = operation.graph._get_function(name)  # pylint: disable=protected-access
      if found is not None and name not in seen:
        seen.add(name)
        pending.extend(found.graph.get_operations())


def _called_function_names(operation):
  """The names of the functions `operation`'s attributes name."""
  for value in operation.node_def.attr.values():
    if value.HasField("func"):
      yield value.func.name
    for function in value.list.func:
      yield function.name


def _copy_called_functions(operations, source, target):
  """Adds to `target` the functions of `source` that `operations` call.

  pfor copies an op that does not vary along its loop (a loop or a branch
  of values the same at every position) into the caller's graph as it is,
  with the names of the functions it calls but not the functions, which
  stay in the per-position graph.
  """
  for operation in operations:
    for name in _called_function_names(operation):
      found = source._get_function(name)  # pylint: disable=protected-access
      if found is not None and target._get_function(name) is None:  # pylint: disable=protected-access
        target._add_function_recursive(found)  # pylint: disable=protected-access


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
  found = _LOOP_VARIANT_INPUT.search(message)
  if found:
    return found.group(1), None
  return None


_LOOP_INVARIANT_INPUT = re.compile(
    r"""Input "(\w+)" of op '(\w+)' expected to be loop invariant""")
# pfor's converters of some ops handle only a per-position value there.
_LOOP_VARIANT_INPUT = re.compile(
    r"""Input "\w+" of op '(\w+)' expected to be not loop invariant""")


def wrap_converted(tensor, stacked):
  """The value a pfor converter returns for one output."""
  return _pfor.wrap(tensor, stacked)


def converted_outputs(returned):
  """The `ConvertedValue` of each output, from what a pfor converter returned.

  A converter returns one wrapped value for an op of one output, or a list.
  """
  if isinstance(returned, _pfor.WrappedTensor):
    returned = [returned]
  return [ConvertedValue(w.t, w.is_stacked) for w in returned]


def default_pfor_converter(op_type):
  """pfor's own converter for ops of `op_type`, called with an `OpInputs`."""
  converter = _pfor._pfor_converter_registry[op_type]  # pylint: disable=protected-access
  return lambda op_inputs: converter(op_inputs._pfor_input)  # pylint: disable=protected-access


def has_default_pfor_converter(op_type):
  """True if pfor has a converter of its own for ops of `op_type`."""
  return op_type in _pfor._pfor_converter_registry  # pylint: disable=protected-access


def refuses_input(error):
  """True if `error`, from a pfor converter, refuses how an input is stacked.

  pfor's converters need some inputs the same on every position (the begin
  of a StridedSlice) or raise `ConversionNotImplementedError` for a case
  they do not handle.
  """
  return isinstance(error, _pfor.ConversionNotImplementedError) or (
      isinstance(error, ValueError) and
      _LOOP_INVARIANT_INPUT.search(str(error)) is not None)


def set_pfor_converter(operation, converter):
  """Makes pfor call `converter(op_inputs)` for `operation`.

  `converter` is given the op's `OpInputs` and returns one
  `wrap_converted` value per output of the op.
  """
  operation.pfor_converter = lambda pfor_input: converter(OpInputs(pfor_input))


def converter_of(operation):
  """What pfor would call for `operation`, as a converter of an `OpInputs`.

  None where pfor has no converter for it (and copies it only where no
  input differs between positions).
  """
  attached = getattr(operation, "pfor_converter", None)
  if attached is not None:
    return lambda op_inputs: attached(op_inputs._pfor_input)  # pylint: disable=protected-access
  if has_default_pfor_converter(operation.type):
    return default_pfor_converter(operation.type)
  return None


def with_inputs(op_inputs, values):
  """`op_inputs` with its inputs replaced by `values` (`ConvertedValue`s)."""
  pfor_input = op_inputs._pfor_input  # pylint: disable=protected-access
  return OpInputs(_pfor._PforInput(  # pylint: disable=protected-access
      pfor_input.pfor, pfor_input.op,
      [_pfor.wrap(v.tensor, v.stacked) for v in values]))


def tracking_wrapper_types():
  """`(list wrapper, dict wrapper)`: what a tf.Module's list and dict become."""
  return _data_structures.ListWrapper, _data_structures._DictWrapper  # pylint: disable=protected-access


def wait_for_pending_ops():
  """Blocks until every op dispatched in eager mode has finished."""
  _context.async_wait()


def host_view(tensor):
  """`tensor`'s value as a NumPy array sharing its buffer (no copy).

  Waits for the value with the GIL released, as every read of a tensor
  does; `.numpy()` would copy the buffer as well.
  """
  return tensor._numpy()  # pylint: disable=protected-access


def dtensor_device():
  """DTensor's device object (`DTensorDevice`), or None before its first use."""
  return _dtensor_api._dtensor_singleton  # pylint: disable=protected-access


def dtensor_lowerings_and_kernels():
  """`(lowerings, compiled functions)` DTensor's device made so far.

  Its SPMD lowerings (misses of its function cache) and the functions
  TensorFlow's eager runtime compiled for it (its kernel cache); (0, 0)
  before its first use.
  """
  device = dtensor_device()
  if device is None:
    return 0, 0
  stats = device._get_stats()  # pylint: disable=protected-access
  return stats["function_manager.miss"], stats["kernel_cache.size"]


def dtensor_layout_text(tensor):
  """The layout of the eager DTensor `tensor`, as DTensor writes it; None if plain.

  A tenth of the time of `dtensor.fetch_layout(tensor).mesh` and of hashing
  the Mesh it makes, for a check on every input of a call.
  """
  device = dtensor_device()
  if device is None:
    return None
  handle = _context.context()._handle  # pylint: disable=protected-access
  info = device._device_info  # pylint: disable=protected-access
  if not _pywrap_dtensor_device.IsDTensor(handle, tensor, info):
    return None
  return _pywrap_dtensor_device.FetchLayout(handle, tensor, info)


# What a tf.function's concrete function takes and returns: its
# `unpack_inputs` turns each call's arguments into the function's inputs.
FunctionType = _function_type.FunctionType


def argument_of_each_input(function_type, bound_parameters):
  """The name of the argument each of a call's inputs comes from.

  In the order `function_type.unpack_inputs(bound_parameters)` gives the
  inputs: its parameters in its own order, an input passed twice (a
  variable) once.
  """
  names = []
  for parameter in function_type._sorted_parameters:  # pylint: disable=protected-access
    names += [parameter.name] * len(parameter.type_constraint.to_tensors(
        bound_parameters.arguments[parameter.name]))
  kept, seen = [], set()
  for name, input_type in zip(names, function_type.flat_inputs):
    alias = input_type._alias_id()  # pylint: disable=protected-access
    if alias is None or alias not in seen:
      kept.append(name)
    if alias is not None:
      seen.add(alias)
  return kept


def on_new_concrete_function(callback):
  """Calls `callback(concrete_function)` for every function traced from now on."""
  if callback not in _function_transform.CONCRETE_FUNCTION_CALLBACKS:
    _function_transform.CONCRETE_FUNCTION_CALLBACKS.append(callback)


def set_function_type(concrete_function, function_type):
  """Gives `concrete_function` the `FunctionType` its calls go through."""
  concrete_function._function_type = function_type  # pylint: disable=protected-access


def new_dtensor_device():
  """Makes DTensor use a new (asynchronous, as its own) device; returns it.

  Tensors already on the previous device stay there, readable through its
  object (`device.unpack`).
  """
  _dtensor_api.reset_dtensor_device(is_async=True)
  return dtensor_device()


def error_code(name):
  """TensorFlow's error code of the status name `name` ("INVALID_ARGUMENT")."""
  return _error_codes.Code.Value(name)


def error_class(code):
  """The `tf.errors.OpError` subclass TensorFlow raises for error `code`."""
  return _errors_impl.exception_type_from_error_code(code)


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


def publish(key, value):
  """Puts `value` under `key` in the coordination service's key-value store."""
  _context.context().set_config_key_value(key, value)


def read_published(key, timeout_s):
  """The value another process published under `key`, waiting `timeout_s`.

  Raises:
    tf.errors.DeadlineExceededError: If nothing is published in time.
  """
  return _context.context().get_config_key_value(key, int(timeout_s * 1000))


def check_peer_alive(task, timeout_s):
  """Raises `tf.errors.UnavailableError` if the process `task` is gone.

  `task` is '/job:NAME/replica:0/task:N'; the probe waits `timeout_s`.
  """
  _context.context().check_collective_ops_peer_health(
      task, int(timeout_s * 1000))


def options_without_grappler():
  """This thread's function call options, with grappler turned off.

  grappler is TensorFlow's graph optimizer; the options are otherwise those
  TensorFlow passes to every function call.
  """
  return _without_grappler(_context.context().function_call_options)


class CallOptions:
  """Within it, this thread's function calls run under `options`.

  Args:
    options: From `options_without_grappler`.
  """

  __slots__ = ("_options", "_saved", "_local")

  def __init__(self, options):
    self._options = options
    self._saved = None
    self._local = None

  def __enter__(self):
    self._local = _context.context()._thread_local_data  # pylint: disable=protected-access
    self._saved = self._local.function_call_options
    self._local.function_call_options = self._options
    return self

  def __exit__(self, *exc):
    self._local.function_call_options = self._saved
    return False


def flat_call(concrete_function):
  """`ConcreteFunction._call_flat`: calls it on `(tensors, captured)`."""
  return concrete_function._call_flat  # pylint: disable=protected-access


def plain_caller(concrete_function):
  """Calls `concrete_function` on a flat list of tensors, its captures added.

  As `flat_caller`, without re-binding the arguments at every call; for
  programs that DTensor does not lower (the host executor's), so with none
  of DTensor's renaming.
  """
  call_flat = concrete_function._call_flat  # pylint: disable=protected-access
  captured = concrete_function.captured_inputs
  return lambda tensors: call_flat(tensors, captured)


def without_xla(concrete_function):
  """A function of the same graph as `concrete_function`, run without XLA.

  `tf.function(jit_compile=True)` marks its functions for XLA; this one is
  made of the same graph, unmarked, so TensorFlow's kernels run its ops one
  by one: the route of a program XLA cannot compile.
  """
  return _concrete_function.ConcreteFunction.from_func_graph(
      concrete_function.graph, concrete_function.function_type,
      {"_noinline": True})


_XLA_REFUSED = re.compile(
    r"tf2xla conversion failed|Detected unsupported operations when trying "
    r"to compile|XLA compilation requires|must be a compile-time constant")


def xla_refused(error):
  """Whether `error` is XLA's refusal to compile a program (not a run failure).

  XLA compiles a program before any of its ops runs, so a program it
  refused ran nothing.
  """
  return bool(_XLA_REFUSED.search(str(error)))


def _without_grappler(options):
  """`options` (`FunctionCallOptions`) with grappler's meta optimizer off."""
  config = _config_pb2.ConfigProto()
  if options.config_proto_serialized:
    config.ParseFromString(options.config_proto_serialized)
  config.graph_options.rewrite_options.disable_meta_optimizer = True
  return _context.FunctionCallOptions(executor_type=options.executor_type,
                                      config_proto=config)


def tape_may_record(tensors):
  """True if an active GradientTape records operations on `tensors`."""
  return _record.could_possibly_record() and bool(
      _record.should_record_backprop(tensors))


@contextlib.contextmanager
def op_callback(callback):
  """Calls `callback(op_type, ...)` for each op this thread runs or traces.

  Eager ops are reported after they ran; raising from `callback` stops the
  program there.
  """
  _op_callbacks.add_op_callback(callback)
  try:
    yield
  finally:
    _op_callbacks.remove_op_callback(callback)


# The checks `before_variable_writes` runs, per thread.
_write_checks = threading.local()
_write_guards_lock = threading.Lock()
# How many threads are inside `before_variable_writes`.
_guarded_blocks = [0]


def _guarded_write(function, op_type):
  """`function`, an op wrapper writing a variable, after this thread's checks."""
  @functools.wraps(function)
  def write(*args, **kwargs):
    checks = getattr(_write_checks, "stack", ())
    if checks:
      resource = args[0] if args else kwargs.get("resource", kwargs.get("var"))
      for check in checks:
        check(op_type, resource)
    return function(*args, **kwargs)
  return write


@functools.lru_cache(maxsize=1)
def _variable_write_wrappers():
  """`(namespace, name, wrapper, guarded)` of TensorFlow's variable writers.

  `tf.Variable.assign` and its kin, the scatters and the optimizers' apply
  ops call these module functions (or their `tf.raw_ops` forms); `guarded`
  calls `wrapper` after the checks. Found once per process.
  """
  by_lower_name = {name.lower(): name for name in dir(tf.raw_ops)}
  found = []
  for module in (_gen_variables, _gen_state, _gen_training):
    for name in dir(module):
      op_type = by_lower_name.get(name.replace("_", ""))
      if op_type is not None and op_types.writes_variable(op_type):
        for namespace, attribute in ((module, name), (tf.raw_ops, op_type)):
          wrapper = getattr(namespace, attribute)
          found.append((namespace, attribute, wrapper,
                        _guarded_write(wrapper, op_type)))
  return tuple(found)


@contextlib.contextmanager
def _write_guards():
  """TensorFlow's variable writers go through the checks while it runs.

  Op callbacks see an eager op after it ran; a check in the wrapper the
  op's Python API calls can stop a write before it happens. The wrappers
  are replaced when the first thread enters and put back when the last one
  leaves; a thread with no checks meanwhile pays one lookup.
  """
  with _write_guards_lock:
    if not _guarded_blocks[0]:
      for namespace, name, _, guarded in _variable_write_wrappers():
        setattr(namespace, name, guarded)
    _guarded_blocks[0] += 1
  try:
    yield
  finally:
    with _write_guards_lock:
      _guarded_blocks[0] -= 1
      if not _guarded_blocks[0]:
        for namespace, name, wrapper, _ in _variable_write_wrappers():
          setattr(namespace, name, wrapper)


@contextlib.contextmanager
def before_variable_writes(check):
  """Calls `check(op_type, resource)` before this thread writes a variable.

  Covers writes through TensorFlow's Python API (`tf.Variable.assign`,
  `scatter_*`, optimizers' apply ops, `tf.raw_ops`); raising from `check`
  stops the write before it runs. An op built otherwise bypasses it (an op
  callback sees it, after it ran). TensorFlow's functions are as they were
  once no thread is inside.
  """
  stack = getattr(_write_checks, "stack", ())
  with _write_guards():
    _write_checks.stack = stack + (check,)
    try:
      yield
    finally:
      _write_checks.stack = stack


def record_backward(name, outputs, inputs, backward):
  """Records on the active GradientTapes that `outputs` came from `inputs`.

  The tapes differentiate them with `backward(*output_gradients)`, which
  gives one gradient (or None) per input.
  """
  _record.record_operation(name, outputs, inputs, backward)


def tape_active():
  """True if any GradientTape is recording."""
  return _record.could_possibly_record()


class ConvertedValue:
  """What pfor made of one tensor: `tensor`, stacked along the loop or not.

  Unpacks as `tensor, stacked = value`.
  """

  __slots__ = ("tensor", "stacked")

  def __init__(self, tensor, stacked):
    self.tensor = tensor
    self.stacked = stacked

  def __iter__(self):
    return iter((self.tensor, self.stacked))


class OpInputs:
  """The op pfor is converting and its converted inputs.

  Every converter tfspmd gives pfor is called with one, in place of pfor's
  private `_PforInput`: the only view of pfor's converter protocol that the
  rest of tfspmd uses.
  """

  __slots__ = ("_pfor_input",)

  def __init__(self, pfor_input):
    self._pfor_input = pfor_input

  @property
  def op(self):
    """The `tf.Operation` of the per-position program being converted."""
    return self._pfor_input.op

  @property
  def num_inputs(self):
    return self._pfor_input.num_inputs

  @property
  def loop_size(self):
    """The number of loop positions being converted, as a Python int."""
    return int(tf.get_static_value(
        self._pfor_input.pfor.loop_len_vector)[0])

  def input(self, index):
    """Input `index` as a `ConvertedValue`."""
    wrapped = self._pfor_input.input(index)
    return ConvertedValue(wrapped.t, wrapped.is_stacked)

  def inputs(self):
    """Every input, as `ConvertedValue`s."""
    return [self.input(k) for k in range(self.num_inputs)]

  def unstacked_input(self, index):
    """Input `index`, which must be the same on every position."""
    return self._pfor_input.unstacked_input(index)

  def stacked_input(self, index):
    """Input `index` with the loop axis in front.

    An input the same on every position is repeated along the loop axis.
    """
    self._pfor_input.stack_inputs(stack_indices=[index])
    return self._pfor_input.stacked_input(index)

  def broadcast_inputs(self):
    """Every input stacked, or given a loop axis of 1, to broadcast together."""
    self._pfor_input.expanddim_inputs_for_broadcast()
    return [self._pfor_input.input(k).t for k in range(self.num_inputs)]

  def get_attr(self, name):
    return self._pfor_input.get_attr(name)


def function_graph(operation, attr):
  """The FuncGraph of the function attribute `attr` of `operation`.

  `attr` names one function (While's "body") or, with an index, one of a
  list (`("branches", 2)` of a Case).
  """
  if isinstance(attr, tuple):
    name = operation.get_attr(attr[0])[attr[1]].name
  else:
    name = operation.get_attr(attr).name
  return operation.graph._get_function(name).graph  # pylint: disable=protected-access


class Conversion:
  """One pfor conversion of a graph's ops into the graph being built."""

  def __init__(self, converter, size):
    self._converter = converter
    self.size = size

  def convert(self, tensor):
    """The `ConvertedValue` of `tensor`, converting what it depends on."""
    found = self._converter._convert_helper(tensor)  # pylint: disable=protected-access
    return ConvertedValue(found.t, found.is_stacked)

  def define(self, tensor, value):
    """Makes `value` (a `ConvertedValue`) the conversion of `tensor`."""
    self._converter._add_conversion(  # pylint: disable=protected-access
        tensor, _pfor.wrap(value.tensor, value.stacked))

  def apply(self, operation, converter):
    """Runs `converter(op_inputs)` for `operation` as pfor would."""
    inputs = [self._converter._convert_helper(t) for t in operation.inputs]  # pylint: disable=protected-access
    op_inputs = OpInputs(_pfor._PforInput(self._converter, operation, inputs))  # pylint: disable=protected-access
    return [ConvertedValue(w.t, w.is_stacked) for w in converter(op_inputs)]


def convert_in_loop(op_inputs, tensor):
  """The `ConvertedValue` of `tensor`, of the loop `op_inputs`'s op is in.

  For a converter that reads more than its op's inputs (a print reads
  those of the StringFormat before it).
  """
  found = op_inputs._pfor_input.pfor._convert_helper(tensor)  # pylint: disable=protected-access
  return ConvertedValue(found.t, found.is_stacked)


def convert_graph_inline(op_inputs, graph, inputs, prepare, operations=()):
  """Vectorizes the ops of a function graph into the graph being built.

  pfor's own converters of function-calling ops (While, If, a call) wrap
  the converted body in a nested `tf.function`; DTensor cannot place many
  of those. This converts the body's ops in place instead, in the same
  pfor loop as `op_inputs`'s op.

  Args:
    op_inputs: The `OpInputs` of the op that calls `graph`.
    graph: The FuncGraph, whose inputs are fed `inputs`.
    inputs: One `ConvertedValue` per `graph.inputs`.
    prepare: `prepare(conversion, operations)`, run before the outputs are
      converted, may define the conversion of some of `graph`'s tensors.
    operations: Ops of `graph` no output needs, to convert as well (its
      side effects).

  Returns:
    One `ConvertedValue` per output of `graph`.
  """
  outer = op_inputs._pfor_input.pfor  # pylint: disable=protected-access
  size = op_inputs.loop_size
  conversion = Conversion(_pfor.PFor(
      loop_var=outer.loop_var, loop_len=size,
      pfor_ops=graph.get_operations(), fallback_to_while_loop=False,
      all_indices=outer.all_indices,
      all_indices_partitioned=outer.all_indices_partitioned,
      pfor_config=outer.pfor_config), size)
  for placeholder, value in zip(graph.inputs, inputs):
    conversion.define(placeholder, value)
  prepare(conversion, graph.get_operations())
  caller = tf.compat.v1.get_default_graph()
  first_op = len(caller.get_operations())
  outputs = [conversion.convert(tensor) for tensor in graph.outputs]
  for operation in operations:
    for target in operation.outputs or [operation]:
      conversion._converter._convert_helper(target)  # pylint: disable=protected-access
  _copy_called_functions(caller.get_operations()[first_op:], graph, caller)
  return outputs


def stacked(value, size):
  """`value.tensor` with the loop axis in front, repeated if unstacked."""
  if value.stacked:
    return value.tensor
  return _pfor._stack(value.tensor, [size]).t  # pylint: disable=protected-access


def scratch_graph():
  """A throw-away function graph to trace into (captures outer tensors)."""
  return _func_graph.FuncGraph("tfspmd_scratch").as_default()


def is_loop_gradient_body(graph):
  """True if `graph` is the body of the backward loop of a while_v2 loop."""
  return isinstance(graph, _while_v2._WhileBodyGradFuncGraph)  # pylint: disable=protected-access


def recreate_op(operation, inputs):
  """A copy of `operation` (type and attributes) on `inputs`; its outputs."""
  copy = _pfor._create_op(  # pylint: disable=protected-access
      operation.type, inputs, [t.dtype for t in operation.outputs],
      operation.node_def.attr)
  return copy.outputs


def recreate_op_eagerly(operation, inputs):
  """`operation` (type and attributes) run eagerly on `inputs`; its outputs."""
  attrs = []
  for name in operation.node_def.attr:
    # Attributes with a leading underscore are tracing's, not the op's.
    if not name.startswith("_"):
      attrs.extend([name, operation.get_attr(name)])
  return _execute.execute(
      operation.type.encode(), len(operation.outputs),
      inputs=[tf.constant(v) for v in inputs], attrs=tuple(attrs),
      ctx=_context.context())


def user_op_name(operation):
  """`operation`'s name as the user's code made it, without pfor's suffixes."""
  return operation.name.split("/pfor/")[0]


def in_loop_body(operation):
  """Whether `operation` lies in the body of a `tf.while_loop` (or its gradient)."""
  return isinstance(operation.graph, _control_flow_util.WhileBodyFuncGraph)


def _in_control_flow(graph):
  return isinstance(graph, (_control_flow_util.WhileBodyFuncGraph,
                            _control_flow_util.WhileCondFuncGraph,
                            _control_flow_util.CondBranchFuncGraph))


def outside_control_flow(tensor):
  """What `tensor`, captured into a loop's or a branch's graph, stands for.

  Returns:
    `(graph, outer)`: the graph just outside the outermost loop body, loop
    condition or branch that encloses `tensor`'s graph (or is it), and the
    tensor that `tensor` captures from there or from further out (through
    every graph between); None where no such graph encloses it, or where
    `tensor` is computed inside.
  """
  chain = [tensor.graph]
  while isinstance(chain[-1], _func_graph.FuncGraph) and (
      chain[-1].outer_graph is not None):
    chain.append(chain[-1].outer_graph)
  inside = [k for k, graph in enumerate(chain) if _in_control_flow(graph)]
  if not inside:
    return None
  target = chain[inside[-1] + 1]
  # A graph may capture a tensor of any enclosing graph, or an eager one,
  # directly, skipping the graphs between.
  graph = tensor.graph
  while graph is not target and graph in chain:
    tensor = next((external for external, internal in graph.captures
                   if internal is tensor), None)
    if tensor is None:
      return None
    if isinstance(tensor, tf.__internal__.EagerTensor):
      break
    graph = tensor.graph
  return target, tensor


def reachable(tensor):
  """`tensor`, captured graph by graph into the graph being built.

  A function graph captures a tensor of an enclosing graph directly, and
  the graphs between learn of it only when the function is called. The
  gradient of a `tf.cond` inside a `tf.while_loop` asserts that what its
  graph captures lives in the graph just outside it (cond_v2, TF 2.21), so
  a tensor of the per-device graph (a loop index) is captured into each
  enclosing function graph in turn, outermost first.
  """
  if not hasattr(tensor, "graph"):  # A Python or eager index (debug mode).
    return tensor
  graph = tf.compat.v1.get_default_graph()
  between = []
  while graph is not tensor.graph and isinstance(graph, _func_graph.FuncGraph):
    between.append(graph)
    graph = graph.outer_graph
  if graph is not tensor.graph:
    return tensor
  for inner in reversed(between):
    tensor = inner.capture(tensor)
  return tensor
