"""Which route each op of a traced program took, for docs/ops.md.

pfor maps most ops with its own converters; the others take tfspmd's per
position route (`per_position`), and DTensor computes the ops it has no
expander for whole on every device (`replicated_ops`). Inside `recording()`
each route notes the op types it took while a program traces.
"""

import contextlib

from tfspmd._src.core import trace_context

PER_POSITION = "per position"
REPLICATED = "replicated"


def record(route, op_type):
  """Notes that ops of `op_type` took `route` (when recording)."""
  routes = trace_context.this_thread.routes
  if routes is not None:
    routes.setdefault(route, set()).add(op_type)


@contextlib.contextmanager
def recording():
  """Yields a dict route -> op types, filled while the block traces.

  Example:
    >>> with recording() as routes:
    ...   record(REPLICATED, "Cumprod")
    >>> routes
    {'replicated': {'Cumprod'}}
  """
  context = trace_context.this_thread
  previous, context.routes = context.routes, {}
  try:
    yield context.routes
  finally:
    context.routes = previous
