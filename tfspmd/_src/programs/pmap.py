"""pmap: the mapped function, and which way each call goes.

`pmap(fun)` checks its arguments once (`pmap_options`) and returns a
`PmappedFunction`. Each call takes one of four paths:
  - debug mode: each device's program runs eagerly in a thread
    (`debug.call`);
  - inside an enclosing pmap's trace: one more mesh dimension
    (`pmap_nested`);
  - inside the user's own `tf.function`: the program's ops go into the
    user's graph (`pmap_in_graph`);
  - at the top level: look up or trace the program of the call's signature
    (`pmap_trace`), place the inputs, run, wrap the results
    (`pmap_top_level`); under a `GradientTape` the call is recorded with its
    pmapped VJP (`pmap_gradient`).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Sequence
import functools
from typing import Any

import tensorflow as tf

from tfspmd._src.arguments import pmap_donation
from tfspmd._src.core import debug_mode
from tfspmd._src.core import function_keys
from tfspmd._src.core import lru
from tfspmd._src.core import tf_internal
from tfspmd._src.programs import pmap_gradient
from tfspmd._src.programs import pmap_in_graph
from tfspmd._src.programs import pmap_nested
from tfspmd._src.programs import pmap_options
from tfspmd._src.programs import pmap_top_level
from tfspmd._src.programs import pmap_trace
from tfspmd._src.programs.debug import call as debug_call
from tfspmd._src.runtime import axis_env
from tfspmd._src.runtime import devices as devices_lib
from tfspmd._src.trees import tree


class PmappedFunction:
  """The callable `pmap` returns; call it like the function it maps."""

  def __init__(self, options: pmap_options.PmapOptions):
    self._options = options
    self._programs = lru.LRUCache(lru.TRACE_CACHE_SIZE)
    self._vjps = lru.LRUCache(lru.TRACE_CACHE_SIZE)
    functools.update_wrapper(self, options.fun, updated=())

  @property
  def options(self) -> pmap_options.PmapOptions:
    """The pmap's checked arguments."""
    return self._options

  def over_the_same_axis(self, fun, in_axes, out_axes, debug=False):
    """A pmap of `fun` over this one's axis, devices and axis size.

    The pmap of a VJP: it keeps the forward's axis size, since the VJP has
    no mapped argument when the forward had none (a shard_map axis no spec
    names).
    """
    options = self._options
    return PmappedFunction(pmap_options.checked_options(
        fun, axis_name=options.axis_name, in_axes=in_axes, out_axes=out_axes,
        devices=options.devices, backend=options.backend,
        axis_size=options.args.axis_size, debug=debug, level=options.level))

  @property
  def programs(self) -> lru.LRUCache:
    """The compiled programs of this pmap, by call signature."""
    return self._programs

  def __repr__(self):
    return (f"<pmap of {self._options.fun!r} over axis "
            f"{self._options.axis_name!r}>")

  def __get__(self, instance, owner):
    if instance is None:
      return self
    return functools.partial(self, instance)

  # Inside a user's tf.function AutoGraph would convert tfspmd's own code
  # (and mix up its converted functions); `fun` is never converted either.
  @tf.autograph.experimental.do_not_convert
  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    options = self._options
    if options.donate_argnums:
      pmap_donation.check_positions(options.donate_argnums, len(args))
    # Each way a call can go takes the same (pmapped, args, kwargs).
    if options.debug or debug_mode.active():
      return debug_call.call(self, args, kwargs)
    if axis_env.trace_state() is not None:
      return pmap_nested.call(self, args, kwargs)
    if tf.inside_function():
      return pmap_in_graph.call(self, args, kwargs)
    return self._call_top_level(args, kwargs)

  def _call_top_level(self, args, kwargs):
    options = self._options
    # A call like an earlier one, with no tape to record it, skips binding.
    known = (None if tf_internal.tape_active() else
             pmap_top_level.known_call(options, self._programs, args, kwargs))
    if known is not None:
      program, values = known
      return self._results(
          program, pmap_top_level.run(program, values, options.axis_name),
          args)
    call = options.args.bind(args, kwargs)
    values, key = pmap_top_level.values_and_key(call)
    program = pmap_trace.cached_program(options, self._programs, key, call,
                                        values)
    if tf_internal.tape_active() and (
        program.trainable_variables or tf_internal.tape_may_record(
            [v for v in values if isinstance(v, tf.Tensor)])):
      outputs = pmap_gradient.recorded_call(
          lambda tensors: [tf.convert_to_tensor(r) for r in
                           pmap_top_level.run(program, tensors,
                                              options.axis_name)],
          self._vjp(key, program, call),
          [tf.convert_to_tensor(v) for v in values], program.size)
      return program.output_treedef.unflatten(list(outputs))
    return self._results(
        program, pmap_top_level.run(program, values, options.axis_name), args)

  def _results(self, program, results, args):
    """The call's output tree, once the donated arguments are freed."""
    if self._options.donate_argnums:
      pmap_donation.delete_donated(self._options.donate_argnums, args,
                                   results)
    return program.output_treedef.unflatten(results)

  def _vjp(self, key, program, call):
    """The pmapped VJP of the call signature `key`, made once."""
    vjp = self._vjps.get(key)
    if vjp is None:
      options = self._options
      vjp = pmap_gradient.VjpProgram(
          self.over_the_same_axis, options.fun, call.rebuilder(), call.in_axes,
          program.output_axes, program.trainable_variables,
          options.axis_name)
      self._vjps.put(key, vjp)
    return vjp


def pmap(
    fun: Callable[..., Any] | None = None,
    axis_name: Hashable | None = None, *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    static_broadcasted_argnums: int | Sequence[int] = (),
    devices: Sequence[devices_lib.Device] | None = None,
    backend: str | None = None,
    axis_size: int | None = None,
    donate_argnums: int | Sequence[int] = (),
    steps: int | None = None,
    debug: bool = False,
    jit_compile: bool = True,
) -> Callable[..., Any]:
  """Maps `fun` over an axis of its arguments, one position per device.

  `fun` is the program one device runs, written with TensorFlow ops; it may
  call named-axis collectives (`tfspmd.lax.psum`, ...) over `axis_name`. The
  mapped function traces `fun` once per distinct call signature into one
  `tf.function(jit_compile=True)` that DTensor runs on a mesh of the devices.

  Args:
    fun: The per-device function. Its arguments and results are tensors,
      NumPy arrays or Python numbers in tuples, lists, dicts or namedtuples.
    axis_name: A hashable name for the mapped axis, used by collectives.
    in_axes: For each positional argument, the axis to map over (any axis,
      negative counts from the end), None to broadcast it to every device,
      or a tree prefix of the arguments holding those. Keyword arguments are
      mapped over axis 0.
    out_axes: Where the mapped axis goes in each output (an int, or None for
      an output that is the same on every device: one copy is returned), or a
      tree prefix of the output.
    static_broadcasted_argnums: Positions of arguments passed as Python
      values (hashable); each new value traces again.
    devices: The `Device`s to map over, in order (from `tfspmd.devices()`);
      the mapped size must equal the number of them local to this process.
    backend: 'cpu', 'gpu' or 'tpu'; None picks the best present.
    axis_size: The size of the mapped axis when no argument is mapped.
      With several processes, a nested pmap's `axis_size` is the global
      size of its axis, which may cross processes (below).
    donate_argnums: Positions of arguments whose `ShardedArray` leaves the
      call frees; using one again raises.
    steps: Run `fun` this many times in one compiled call (a loop inside the
      program, so the dispatch cost is paid once per `steps`), as
      `carry, y = fun(carry, *xs_t)`: the first argument is the carry, every
      other argument has one slice per step along its first per-device
      axis. The call returns `(last carry, ys)`, with the `y` of every step
      stacked along a new first per-device axis.
    debug: If True, run in debug mode (below) instead of compiling.
    jit_compile: As `tf.function` takes it. On a mesh of CPU devices (the
      host executor), False runs the program through TensorFlow's kernels op
      by op instead of compiling it with XLA: its first call costs a
      fraction of XLA's compile (which grows with the program: about 0.7 s
      for a Keras MLP's training step), and later calls may run slower. On
      accelerators the program is always compiled by XLA.

  Returns:
    A callable with `fun`'s arguments (with the extra mapped axes), returning
    `fun`'s outputs with the mapped axis added, as `ShardedArray`s.

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> print(tfspmd.pmap(lambda x: x ** 2)(tf.range(8)))
    [ 0  1  4  9 16 25 36 49]
    >>> f = tfspmd.pmap(lambda x, y: (x + y, y * 2.), in_axes=(0, None))
    >>> f(tf.range(2.), 4.)
    (ShardedArray([4., 5.], dtype=float32, axis 0 over 2 devices),
     ShardedArray([8., 8.], dtype=float32, axis 0 over 2 devices))

    Three steps of a running sum per device in one call:

    >>> step = lambda total, x: (total + x, total)
    >>> total, seen = tfspmd.pmap(step, steps=3)(tf.zeros(2), tf.ones((2, 3)))
    >>> print(total)
    [3. 3.]
    >>> print(seen)
    [[0. 1. 2.]
     [0. 1. 2.]]

  Trace cache:
    Each pmapped function keeps the programs of its 64 most recently used
    call signatures (`tfspmd._src.core.lru.TRACE_CACHE_SIZE`): shapes, dtypes,
    tree structure, static values. A call with a signature beyond those
    drops the least recently used program, so calls with ever-new shapes
    trace every time but do not grow memory; pad or bucket shapes to stay
    within the limit.

  Several processes:
    After `tfspmd.distributed.initialize()` in every process, every process
    calls the same pmaps in the same order, each with a mapped size equal to
    its number of devices used (the first ones of each process). Each passes
    its own part and gets back its own part (a `ShardedArray` of its local
    blocks), while `axis_size`, `axis_index` and the collectives span the
    devices of all processes: the mapped axis is the processes' parts one
    after another. With `devices=`, give every process the same list; each
    maps over the ones it owns.

    Nested pmaps' axes form a grid over `tfspmd.devices()` in process order
    (outer axis slowest), as in one process, and each process passes, for
    each mapped input, the block of the global array its own devices hold:
    leading dimensions its positions along the outer axis, then along each
    inner axis. A nested axis lies within each process unless its pmap is
    given `axis_size=` its global size, larger than what the processes pass
    along it: the axis then crosses processes. With 4 processes of 2
    devices, an outer axis of 2 and an inner one of 4
    (`pmap(pmap(f, 'i', axis_size=4), 'o')`), each process holds 1 outer
    and 2 inner positions and passes arrays of leading shape (1, 2); with 8
    processes of 1 device, outer 4 and inner 2, leading shape (1, 1). A
    process's devices must form a block of the grid (every combination of
    their positions) whose shape is what it passes, else a `ValueError`
    names the process, its positions and the shape to pass. Results come
    back as this process's block the same way.

  Prints and checks:
    `tf.print`, `tf.debugging.Assert`, the `tf.debugging.assert_*`
    functions and `tf.debugging.check_numerics` (`assert_all_finite`) inside
    `fun` happen on every call, as in a `tf.function`, whether or not an
    output depends on them: their inputs leave the compiled program as extra
    outputs and the effect happens after it ran, once per device in device
    order with that device's values (as `jax.debug.print` prints once per
    device), in the order `fun` has them; a nested pmap's devices come row
    by row. A failed check raises `tf.errors.InvalidArgumentError` with the
    check's message and the failing device, and the call returns nothing.
    Inside a `tf.cond` they happen on the devices that take the branch.
    Inside a `tf.while_loop`, or with `steps=`, they are an error that says
    to move them out of the loop (or use debug mode). Under a
    `GradientTape` they happen in the forward run only. A passing check
    costs the call a wait for its results and the fetch of its condition.

  Debug mode:
    With `debug=True` (or inside `tfspmd.debug_mode()`), nothing is traced:
    each device's program runs eagerly in its own Python thread, and the
    threads meet at every collective, which computes what the compiled
    program computes. `fun` sees eager tensors: `print` them, branch on
    them, or stop one device (`if axis_index(...) == k: breakpoint()`) and
    step through its program in pdb while the others wait at their next
    collective. pmaps called inside run in debug mode too; a vmap inside
    still vectorizes, with collectives over its own axis only. The results
    are eager `tf.Tensor`s (not `ShardedArray`s: nothing is placed on
    devices) with the structure, shapes and dtypes of the compiled results.
    An exception on a device is raised to the caller with a note naming the
    device, and a program whose devices wait at different collectives
    raises instead of hanging. A `GradientTape` inside `fun` or around the
    call works as in the compiled path. `steps=` is not supported in debug
    mode yet.

    >>> def f(x):
    ...   if tfspmd.lax.axis_index('i') == 1:
    ...     print('device 1 has', x.numpy())
    ...   return tfspmd.lax.psum(x, 'i')
    >>> print(tfspmd.pmap(f, 'i', debug=True)(tf.range(4)))
    device 1 has 1
    tf.Tensor([6 6 6 6], shape=(4,), dtype=int32)
  """
  if fun is None:
    return functools.partial(
        pmap, axis_name=axis_name, in_axes=in_axes, out_axes=out_axes,
        static_broadcasted_argnums=static_broadcasted_argnums,
        devices=devices, backend=backend, axis_size=axis_size,
        donate_argnums=donate_argnums, steps=steps, debug=debug,
        jit_compile=jit_compile)
  return _shared(
      (fun, axis_name, in_axes, out_axes, static_broadcasted_argnums, devices,
       backend, axis_size, donate_argnums, steps, debug, jit_compile),
      lambda: PmappedFunction(pmap_options.checked_options(
          fun, axis_name=axis_name, in_axes=in_axes, out_axes=out_axes,
          static_broadcasted_argnums=static_broadcasted_argnums,
          devices=devices, backend=backend, axis_size=axis_size,
          donate_argnums=donate_argnums, steps=steps, debug=debug,
          jit_compile=jit_compile)))


# The pmaps made lately, by function and arguments: code that calls
# `pmap(f)(x)` afresh each time (in a loop, or inside a step function)
# reuses the first one's traces and compiled programs, as jax.pmap's cache,
# keyed on the function, does; it would otherwise trace and compile on
# every call. A new closure of the same code over the same values counts as
# the same function, and a dropped function frees its pmaps
# (`function_keys.SharedByFunction`).
_RECENT = function_keys.SharedByFunction("pmap")


def _shared(arguments, make):
  """The pmap `make()` gives, shared by calls with equal `arguments`.

  Trees of axes (and the list of devices) count by their structure and
  leaves. Arguments that cannot be hashed (a function object that cannot)
  are not shared.
  """
  fun, *rest = arguments
  try:
    return _RECENT.get_or_put(fun, tuple(
        (treedef, tuple(leaves)) for leaves, treedef in (
            tree.flatten(value) for value in rest)), make)
  except TypeError:
    return make()
