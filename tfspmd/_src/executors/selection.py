"""Which executor runs a program: the host's XLA program, or DTensor's.

`tfspmd_executor` (`tfspmd.config`, `TFSPMD_EXECUTOR`) says:

- 'auto': the host executor (`host`) for a mesh of CPU devices in one
  process, DTensor's SPMD expansion otherwise (accelerators, several
  processes);
- 'host': the host executor, and a clear error for a mesh it cannot run;
- 'dtensor': DTensor's SPMD expansion everywhere.
"""

from tfspmd._src.core.config import config

HOST = "host"
DTENSOR = "dtensor"


def holds_on_host(platforms, process_count):
  """Whether arrays on devices of `platforms` are held whole on the host.

  They are where the host executor runs their programs; unlike
  `executor_for`, this never raises: an array may be made before its
  program is known.
  """
  return config.tfspmd_executor != DTENSOR and process_count == 1 and all(
      p == "cpu" for p in platforms)


def executor_for(platforms, process_count, what):
  """`HOST` or `DTENSOR`: the executor of a program over devices of `platforms`.

  Args:
    platforms: The platform of each device of the program's mesh ('cpu').
    process_count: How many processes the program runs in.
    what: The program, as an error names it ('pmap of step').

  Raises:
    ValueError: If `tfspmd_executor` is 'host' and the mesh is not one of
      CPU devices in one process.
  """
  if holds_on_host(platforms, process_count):
    return HOST
  if config.tfspmd_executor == HOST:
    where = (f"{process_count} processes" if process_count > 1 else
             f"devices of {sorted(set(platforms))}")
    raise ValueError(
        f"{what}: tfspmd_executor is 'host', which runs a mesh of CPU "
        f"devices of one process as one XLA program, but this program's "
        f"mesh spans {where}. Set tfspmd_executor to 'auto' (or 'dtensor') "
        f"with tfspmd.config.update('tfspmd_executor', 'auto') or "
        f"TFSPMD_EXECUTOR=auto.")
  return DTENSOR
