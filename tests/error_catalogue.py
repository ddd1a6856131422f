"""The catalogue of bad inputs: each raises a specific error that says what to change.

Each row of `CATALOGUE` is one kind of mistake: what the user did, code that
does it (the trigger, named as the row), the exception type it must raise
(exactly that type; for a mistake the call goes on from, the warning it
gives, which `raise_warning` raises), and a pattern its message must match:
the argument at fault (its pytree path where it has one), what was expected
and what was given. The rows live in the `error_cases_*` modules, one per
area, in the order docs/errors.md lists them; `all_cases` gathers them and
tests/test_errors.py runs them.
"""

import dataclasses
import importlib
import warnings

import tfspmd


@dataclasses.dataclass(frozen=True)
class Case:
  id: str
  group: str
  what: str
  trigger: object
  error: type
  match: str


CATALOGUE = []

# The modules of rows, in the order of the page.
CASE_MODULES = (
    "error_cases_arguments",
    "error_cases_devices",
    "error_cases_collectives",
    "error_cases_state",
    "error_cases_shard_map",
    "error_cases_pytrees",
    "error_cases_processes",
    "error_cases_shardings",
    "error_cases_checkpoints",
    "error_cases_keras",
)


def case(id_, group, what, error, match):
  """Adds the decorated trigger function to the catalogue as one row."""
  def add(trigger):
    CATALOGUE.append(Case(id_, group, what, trigger, error, match))
    return trigger
  return add


def all_cases():
  """Every row, each module's in its order (importing them adds the rows)."""
  for name in CASE_MODULES:
    importlib.import_module(name)
  return CATALOGUE


def raise_warning(run):
  """Runs `run`, then raises the UserWarning it gave, for a row to match.

  A warning does not stop the call that gives it; raising it afterwards
  lets its row check the type and message as for an error.
  """
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    run()
  for warning in caught:
    if warning.category is UserWarning:
      raise warning.message


P = tfspmd.pmap
SIZES, AXES, STATIC, LEAVES, OUTPUTS, DEVICES, NAMES, COLLECTIVES, OPS, STATE = (
    "Mapped sizes", "in_axes and out_axes", "Static and donated arguments",
    "Argument leaves", "Outputs", "Devices and backends",
    "Axis names", "Collective arguments", "Ops inside the mapped function",
    "State, steps and configuration")
PROCESSES = "Several processes"
SHARD_MAP = "shard_map and meshes"
PYTREES = "Pytrees: tfspmd.tree_util"
SHARDINGS = "Shardings and device_put"
CHECKPOINTS = "Adapters: checkpoints"
KERAS = "Adapters: Keras and tf.data"

# Mistakes whose errors need several real processes or a fresh one, listed
# in the doc so that it is the one place to look; tests/test_multiprocess.py
# (tests/test_devices.py for a fresh process) raises each.
PLACEHOLDERS = [
    (DEVICES, "import tfspmd with TFSPMD_NUM_CPU_DEVICES=8 after a "
     "TensorFlow op ran, the CPU not split into 8 logical devices",
     "RuntimeError at the import: \"TFSPMD_NUM_CPU_DEVICES=8 is set, but "
     "TensorFlow started its devices before tfspmd was imported, with 1 "
     "logical CPU device(s), and cannot split the CPU any more. Import "
     "tfspmd before any TensorFlow op runs, or split the CPU yourself before "
     "the first op: tf.config.set_logical_device_configuration(...)\"; "
     "where the CPU was split into 8 already, the import takes those"),
    (PROCESSES, "a process of the cluster never starts",
     "the others' initialize() raises TimeoutError naming it and its address "
     "after initialization_timeout (docs/multiprocess.md, Faults and "
     "timeouts)"),
    (PROCESSES, "a peer process exits or stops answering during a run",
     "the call, or the read of its results, raises "
     "tfspmd.distributed.PeerFailedError naming it (docs/multiprocess.md)"),
    (PROCESSES, "initialize() twice", "RuntimeError: tfspmd.distributed."
     "initialize() was already called in this process (process 1 of 2); call "
     "it once."),
    (PROCESSES, "a plain tensor passed to your tf.function that calls a "
     "pmap, with several processes", "ValueError when the tf.function is "
     "called: \"a tf.function that calls a pmap over several processes was "
     "given a plain tensor for argument `v`, which is only this process's "
     "part: pass the array the pmap takes as a ShardedArray ... or its "
     "`.dtensor_value`, or call the pmap outside the tf.function.\"; beside "
     "a DTensor a plain tensor is copied whole to every device, and in one "
     "process plain tensors alone run on one device"),
    (PROCESSES, "DTENSOR_JOBS names several processes but initialize() was "
     "not called", "RuntimeError at the first device query: DTENSOR_JOBS "
     "names 2 processes, but the multi-process runtime was not started: call "
     "tfspmd.distributed.initialize() first thing in every process, before "
     "any TensorFlow op."),
    (PROCESSES, "processes started with different num_processes, or two "
     "with one process_id", "ValueError in every process at once, from the "
     "coordinator exchange: \"process 1 was started with num_processes=3, "
     "the coordinator (process 0) with num_processes=2; give every process "
     "the same num_processes.\" / \"two processes registered as process 1; "
     "give each process its own process_id (0..2).\"; a second process 0 "
     "gets OSError: it cannot listen on the coordinator's port"),
    (PROCESSES, "processes with different numbers of devices (another "
     "TFSPMD_NUM_CPU_DEVICES)", "ValueError from initialize() in every "
     "process: \"the processes have different numbers of CPU devices: "
     "process 0 has 2, process 1 has 1. ...\""),
    (PROCESSES, "processes passing one pmap different mapped sizes, "
     "per-device shapes or dtypes", "ValueError at the call or at the read "
     "of its result: \"The processes disagree on this pmapped call: one "
     "process's call spans 4 devices, another's 2 ...\" (or the shapes, or "
     "the dtypes); the other process may get RuntimeError \"... was "
     "cancelled: a collective of it failed in another process first\". "
     "Restart every process"),
    (PROCESSES, "processes passing multihost_utils.process_allgather or "
     "broadcast_one_to_all other tree structures, shapes or dtypes",
     "ValueError in every process: \"process_allgather: process 1 passes "
     "in_tree['w'] of shape (2,) and dtype float32, where process 0 passes "
     "shape (2,) and dtype int32; every process must pass process_allgather "
     "the same tree structure, and leaves of the same shapes and dtypes (pad "
     "to one shape, cast to one dtype).\""),
    (PROCESSES, "a process finishes its program without a pmap the others "
     "call", "the others' call raises tfspmd.distributed.PeerFailedError "
     "\"process 1 (...) finished its program while process 0 waited on it "
     "in a collective: it never called this pmap.\" after "
     "initialization_timeout"),
    (PROCESSES, "a shard_map over a mesh whose devices of one process are "
     "not a block of it, or that holds none of a process's", "ValueError: "
     "\"shard_map: the devices of process 0 are not a block of the mesh "
     "Mesh({'p': 2, 'd': 4}): they lie at positions [(0, 0), (0, 1), (0, 2), "
     "(1, 0)]. ... make the mesh over tfspmd.devices() in process order "
     "(tfspmd.make_mesh(shape, names)).\" (docs/multiprocess.md, shard_map "
     "with several processes)"),
    (PROCESSES, "a shard_map spec splitting a dimension over several mesh "
     "axes of which a later one crosses processes", "ValueError: "
     "\"shard_map: in spec PartitionSpec(('d', 'p')) for args[0] splits "
     "dimension 0 over ('d', 'p'), and the later axis 'p' crosses processes; "
     "with several processes only the first axis splitting a dimension may. "
     "Name 'p' first there, or split another dimension over it.\""),
    (PROCESSES, "a shard_map input whose part in this process does not split "
     "into its devices' blocks", "ValueError: \"shard_map: this process's "
     "part of args[0] has size 3 along dimension 0, which the in spec "
     "PartitionSpec('x') splits into the blocks of this process's mesh "
     "positions (4 along 'x'): 3 is not divisible by 4. ...\""),
    (PROCESSES, "nested pmaps whose axes cross processes, where a "
     "process's devices are not a block of the grid of the shape it passes",
     "ValueError: \"pmap: with several processes the nested pmaps' axes 'o' "
     "(2) x 'i' (4) form a grid over tfspmd.devices() in process order "
     "(outer axis slowest), and process 0's devices lie at its positions "
     "[(0, 0), (0, 1)]: they hold [1, 2] positions along the axes, but its "
     "inputs hold [2, 1]. Pass, for each mapped input, arrays of leading "
     "shape (1, 2): ...\" (or: they are not a block of it ... Choose sizes "
     "for which each process's 3 devices are a block ...; "
     "docs/multiprocess.md, Nested pmaps with several processes)"),
    (PROCESSES, "nested pmaps whose inputs hold more positions than the "
     "process has devices, or a crossing axis's sizes that do not fit",
     "ValueError: \"compiling computation that requires 12 replicas ... "
     "With several processes each process passes, for each mapped input, "
     "the block of the global array its own devices hold: this process's "
     "inputs hold 6 positions of the nested pmaps' grid, but it has 3 "
     "devices. Pass the positions of its devices only, and give a nested "
     "pmap whose axis crosses processes its global size as axis_size= "
     "...\""),
    (PROCESSES, "processes calling pmaps in different orders, or giving "
     "devices= different lists", "not detected: matching collectives give "
     "wrong values, others raise the errors above (docs/multiprocess.md, "
     "Mistakes)"),
]
