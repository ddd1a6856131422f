"""The DTensor switches tfspmd's own programs run with.

DTensor reads a few tuning switches from the environment when it runs and
lowers a function. tfspmd sets two of them, each only while one of its own
programs is called and only for the programs where they measured faster
and gave the same results on the whole test suite. A switch the user set
in the environment (`os.environ`, before or after importing tfspmd) is the
user's: tfspmd neither sets nor removes it, so `os.environ` and the C
environment DTensor reads always agree on it, and the user's value wins
for every program traced or run while it is set. Set the switches before
the first pmap: a program first run under multi-device expansion hangs
when run without it (below), so changing that one later may stop programs
traced before.

This module makes every change tfspmd makes to the C environment, under
`lock`: these switches while a program is called (they differ from program
to program, so they cannot be set once), and the switches DTensor reads
once per process (`set_for_process`).

- `DTENSOR_ENABLE_MULTI_DEVICE_EXPANSION`: DTensor expands the program into
  one function over all devices instead of one per device, which about
  halves the cost of a call (README, performance notes). Only for
  programs on CPU devices of a single process: with several processes
  DTensor fails ("InstantiateOptions.input_devices must have the same
  length"), and GPU and TPU were not measured. Not for every function:
  a user's own non-XLA tf.function that calls a pmap with a psum in a
  `tf.range` loop never returns under it (TF 2.21), and a function first
  run under it hangs when later run without it, so each program runs under
  the same switches every time. Not for programs with a loop (a `While`
  op: tf.while_loop, tf.scan, `steps=`), the long calls (training steps):
  they run as one function per device, whose calls the eager executor's
  wait covers; the expansion makes them no faster
  (benchmarks/loop_expansion.py). After a program
  failed in the process, programs with a loop get it too: run as one
  function per device, they would be cancelled with the failed program's
  error (TF 2.21).
- `LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2`: DTensor's all-gather
  becomes a `CollectiveGatherV2`, which sends (n-1) m per device, instead
  of an all-reduce of a zero-padded n m buffer, which sends 2(n-1) m: half
  the time (docs/collectives.md). Only on a 1-D mesh, for
  programs with no uint32 or uint64 tensors: on meshes of several
  dimensions DTensor's lowering builds a Reshape of the wrong size, and it
  passes unsigned integers to a collective that refuses them, and it puts
  the blocks in device id order, so a pmap over `devices=` in another order
  gets them back in the wrong places (TF 2.21).
  DTensor takes the variable as set whatever its value: a user's "0" or
  "false" turns it on, which a warning says (unset it to turn it off).
"""

import contextlib
import os
import threading
import warnings

from tensorflow.core.framework import types_pb2

from tfspmd._src.core import op_types

MULTI_DEVICE_EXPANSION = "DTENSOR_ENABLE_MULTI_DEVICE_EXPANSION"
COLLECTIVE_GATHER = "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"
_OFF = ("0", "false", "no", "off", "")
_WIDE_UNSIGNED = (types_pb2.DT_UINT32, types_pb2.DT_UINT64)

# DTensor's device is not safe to enter from two threads at once, and it
# reads the C environment whenever it lowers or runs a function, which a
# change of the environment in another thread may be reallocating (TF 2.21;
# glibc's getenv and setenv): one lock guards both. Every call into DTensor's
# device holds it (`dtensor_device.entry`), and so does every change tfspmd
# makes to the C environment, which this module alone makes.
lock = threading.RLock()


def user_settings(environ):
  """The switches set in `environ`, which tfspmd leaves as they are.

  Warns where a value means "off" to a reader but "on" to DTensor.

  Example:
    >>> sorted(user_settings({MULTI_DEVICE_EXPANSION: "1", "HOME": "/"}))
    ['DTENSOR_ENABLE_MULTI_DEVICE_EXPANSION']
  """
  found = {name for name in (MULTI_DEVICE_EXPANSION, COLLECTIVE_GATHER)
           if name in environ}
  value = environ.get(COLLECTIVE_GATHER)
  if value is not None and value.strip().lower() in _OFF:
    warnings.warn(
        f"{COLLECTIVE_GATHER}={value!r} is set: DTensor turns this switch on "
        f"whenever the variable is set, whatever its value, and tfspmd "
        f"leaves your environment as you set it. To turn it off, remove it: "
        f"del os.environ[{COLLECTIVE_GATHER!r}].", stacklevel=2)
  return found


def for_program(devices, mesh_rank, process_count, graph_def,
                user_set=None, after_a_failure=False):
  """The switches a program runs with (a tuple of variable names).

  Args:
    devices: The program's mesh devices (`Device`s), in mesh order.
    mesh_rank: The number of dimensions of its mesh.
    process_count: How many processes run it.
    graph_def: Its `GraphDef` (with the function library), or None for a
      program without loops or wide unsigned integers.
    user_set: The switches the user set (default: those in `os.environ`
      now).
    after_a_failure: Whether a program failed on DTensor's device in this
      process before (`dtensor_device.generation`).

  Example:
    >>> import tfspmd
    >>> in_order = tfspmd.devices()
    >>> for name in for_program(in_order, 1, 1, None, user_set=set()):
    ...   print(name)
    DTENSOR_ENABLE_MULTI_DEVICE_EXPANSION
    LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2
    >>> for_program(in_order[::-1], 1, 1, None, user_set=set())
    ('DTENSOR_ENABLE_MULTI_DEVICE_EXPANSION',)
  """
  if user_set is None:
    user_set = user_settings(os.environ)
  chosen = []
  if ({d.platform for d in devices} == {"cpu"} and process_count == 1 and
      (after_a_failure or not _has_loop(graph_def))):
    chosen.append(MULTI_DEVICE_EXPANSION)
  if (mesh_rank == 1 and in_id_order(devices) and
      not _has_wide_unsigned(graph_def)):
    chosen.append(COLLECTIVE_GATHER)
  return tuple(name for name in chosen if name not in user_set)


def expands(names):
  """Whether a program run with the switches `names` runs under expansion.

  Example:
    >>> expands(())
    False
  """
  return MULTI_DEVICE_EXPANSION in names or MULTI_DEVICE_EXPANSION in os.environ


def in_id_order(devices):
  """Whether `devices` are in ascending id order.

  DTensor's CollectiveGatherV2 and all-to-all lowerings put the blocks in
  device id order whatever the mesh's order (TF 2.21): a pmap over
  `devices=` in another order must not use them.
  """
  ids = [d.id for d in devices]
  return ids == sorted(ids)


def nodes(graph_def):
  """Every node of `graph_def` and of its functions (none for None)."""
  if graph_def is None:
    return []
  nodes = list(graph_def.node)
  for function in graph_def.library.function:
    nodes.extend(function.node_def)
  return nodes


def _has_loop(graph_def):
  return any(node.op in op_types.LOOPS for node in nodes(graph_def))


def _has_wide_unsigned(graph_def):
  for node in nodes(graph_def):
    for value in node.attr.values():
      if value.type in _WIDE_UNSIGNED or any(
          t in _WIDE_UNSIGNED for t in value.list.type):
        return True
  return False


def set_for_process(name):
  """Sets the DTensor switch `name` in the C environment from now on.

  For the switches DTensor reads once per process (`replicated_ops`).
  """
  with lock:
    # putenv, not os.environ: DTensor reads the C environment, and the
    # user's os.environ stays as the user left it.
    os.putenv(name, "1")


def applied(names):
  """Sets the switches `names` while the block runs (one block at a time).

  A switch the user has set since the program was traced is left as the
  user set it.
  """
  return _Applied(names) if names else _NOTHING


_NOTHING = contextlib.nullcontext()


class _Applied:
  """The block of `applied` (a class: cheaper than a generator per call)."""

  def __init__(self, names):
    self._names = names
    self._ours = ()

  def __enter__(self):
    # putenv, not os.environ: DTensor reads the C environment, and the
    # user's os.environ stays as the user left it.
    lock.acquire()
    try:
      self._ours = [name for name in self._names if name not in os.environ]
      for name in self._ours:
        os.putenv(name, "1")
    except BaseException:
      lock.release()
      raise

  def __exit__(self, *exc_info):
    try:
      for name in self._ours:
        os.unsetenv(name)
    finally:
      lock.release()
