"""What this thread's traces are in the middle of: one context per thread.

A pmap, vmap or jit traces in the thread that calls it, and two threads may
trace at once; each keeps the state of its traces here, in one place, as
JAX keeps its trace context. The modules that own each piece read and set
it through `this_thread`, always restoring what they found.

Example:
  >>> this_thread.frames, this_thread.trace
  ([], None)
"""

import threading


class TraceContext(threading.local):
  """The state of the traces the current thread is in.

  Attributes:
    frames: The axes bound now (`axis_env.Frame`s), outermost first.
    trace: The `axis_env.TraceState` of the top-level pmap being traced,
      or None.
    recorders: The recorders of prints and checks (`side_effects`),
      innermost last.
    loop_stacking: The loops' stackings found in the vectorization being
      traced (`control_flow`), or None outside one.
    lane_masks: Where the ops converted now are reached (`lane_guards`),
      innermost last.
    rewriting_ops: Whether the ops traced now are rewritten as DTensor
      needs them (`dtensor_rewrites`).
    jit_mesh: The mesh of the `tfspmd.jit` function being traced, or None.
    jit_shard_map_meshes: The meshes of the shard_maps traced in that
      function (a list), or None outside one.
    jit_merged_outputs: Their results that split a dimension over several
      mesh axes, which no value of the function can lie as: `tensor.ref()`
      -> its `NamedSharding`, or None outside such a function.
    routes: route -> op types, while the routes ops take are recorded
      (`route_log`), or None.
  """

  def __init__(self):
    super().__init__()
    self.frames = []
    self.trace = None
    self.recorders = []
    self.loop_stacking = None
    self.lane_masks = [None]
    self.rewriting_ops = False
    self.jit_mesh = None
    self.jit_shard_map_meshes = None
    self.jit_merged_outputs = None
    self.routes = None


this_thread = TraceContext()
