"""Several processes, one program: DTensor's multi-client runtime.

Every process runs the same Python program and calls `initialize` first;
each then feeds its own devices, and collectives span the devices of all
processes. The runtime is DTensor's: `initialize` sets DTensor's
`DTENSOR_*` variables (DTensor reads its configuration from them) and calls
`dtensor.initialize_accelerator_system`, which starts this process's gRPC
server and joins the others through TensorFlow's coordination service.

Faults, as TensorFlow's runtime reports them (TF 2.21, checked on localhost):
  * a process that never starts: every other process's `initialize` raises
    `TimeoutError` after `initialization_timeout`, naming it;
  * a process that exits after collectives with it ran: a collective
    waiting on it fails at once (its connections are refused);
  * a process that exits before that, or stops answering (a host lost or
    frozen): the coordination service misses its heartbeats for
    `heartbeat_timeout` and aborts every collective waiting on it;
the last two raise `PeerFailedError` from the pmapped call or where its
results are read, as does a process that finishes its program while another
waits on it in a collective. Processes that trace different programs at
the same point (other pmaps, another order, other devices= lists, mapped
sizes, shapes or dtypes) get a `ValueError` saying how, before any
collective runs (`check_same_program`). A process that is alive but never
reaches the collective waits, as in JAX; an order that changes after every
program involved was traced is not seen.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
import math
import os
import re
import threading

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src.core import multiprocess_hooks
from tfspmd._src.core import tf_internal
from tfspmd._src.multiprocess import cluster as cluster_lib
from tfspmd._src.multiprocess import launchers
from tfspmd._src.multiprocess import rendezvous
from tfspmd._src.runtime import devices as devices_lib

NCCL_ENV = "DTENSOR_GPU_USE_NCCL_COMMUNICATION"

_lock = threading.Lock()
_cluster = None  # The `Cluster` once `initialize` succeeded.
_shutdown_timeout_s = None  # `initialize`'s shutdown_timeout_seconds.
_programs_traced = 0  # How many programs this process has checked.
_POLL_S = 1.0  # How often a wait for a peer's trace looks at its health.


class PeerFailedError(RuntimeError):
  """A process this one computes with has exited or stopped answering.

  Raised by a pmapped call whose collectives lost a peer. TensorFlow's
  collective runtime of this process is aborted: restart every process.

  Example:
    >>> import tfspmd
    >>> issubclass(tfspmd.distributed.PeerFailedError, RuntimeError)
    True
  """


_DETECTION_METHODS = (None, "deactivate")


def initialize(coordinator_address: str | None = None,
               num_processes: int | None = None,
               process_id: int | None = None,
               local_device_ids: Sequence[int] | None = None,
               cluster_detection_method: str | None = None,
               initialization_timeout: float = 300,
               heartbeat_timeout_seconds: float = 100,
               shutdown_timeout_seconds: float | None = None,
               coordinator_bind_address: str | None = None,
               slice_index: None = None,
               partition_index: None = None, *,
               process_addresses: Sequence[str] | None = None,
               backend: str | None = None,
               heartbeat_timeout: float | None = None) -> None:
  """Joins this process to the others running the same program.

  Call it in every process, first thing after importing tfspmd, before any
  TensorFlow op. Then `tfspmd.process_index()`, `process_count()`,
  `devices()` (every process's) and `local_devices()` describe the cluster,
  and a pmap maps over the devices of all processes: each process passes
  and receives only its local part (see `tfspmd.pmap`).

  As `jax.distributed.initialize`: `coordinator_address`, `num_processes`
  and `process_id` are enough. Process 0 listens on the coordinator address
  and every process registers there with the host and port it will serve on
  (`rendezvous.py`); then each has every process's address, which DTensor
  needs. With no arguments, the cluster is read from the environment, first
  found first: DTensor's own `DTENSOR_JOBS` (`host:port` of every process,
  process 0 first), `DTENSOR_CLIENT_ID` and `DTENSOR_JOB_NAME`; `TF_CONFIG`
  as Vertex AI, Kubeflow and TensorFlow's cluster resolvers set it (every
  "chief" then "worker" task's address, this process the one its "task"
  names, as `tf.distribute.cluster_resolver.TFConfigClusterResolver` reads
  it); a SLURM job
  (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_STEP_NODELIST`, `SLURM_JOB_ID`);
  an Open MPI job (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
  `OMPI_MCA_orte_hnp_uri`); or on a Cloud TPU VM the slice's hosts
  (`TPU_WORKER_HOSTNAMES`, `TPU_WORKER_ID`, else the VM's metadata server;
  port 8476 unless `coordinator_address` gives one). With nothing there, it
  initializes a single process. The parameters are JAX's, in JAX's order.

  Args:
    coordinator_address: `host:port` of process 0, where the processes find
      each other; process 0 then serves DTensor on another port.
    num_processes: The number of processes.
    process_id: This process's index, from 0 (default `DTENSOR_CLIENT_ID`).
    local_device_ids: GPUs only: the indices of the physical GPUs this
      process uses (as with `CUDA_VISIBLE_DEVICES`).
    cluster_detection_method: None to read SLURM's and Open MPI's variables
      when no coordinator is given, as above; 'deactivate' not to (JAX's
      word). JAX's 'mpi4py' has no counterpart: under mpirun, Open MPI's
      variables are read without it.
    initialization_timeout: Seconds to wait for every process to join (to
      register with the coordinator, and again for DTensor to start).
    heartbeat_timeout_seconds: Seconds of silence after which a process
      counts as failed, and collectives waiting on it raise
      `PeerFailedError`.
    shutdown_timeout_seconds: Seconds `shutdown` (and TensorFlow's own
      barrier as the process exits) waits for the other processes; None
      for `initialization_timeout` (JAX's default is 300 s), so that a
      process whose peers failed exits as soon as it would fail to join.
    coordinator_bind_address: `host:port` process 0 listens on for the
      processes to find each other, when it differs from
      `coordinator_address` (behind a NAT or a proxy); by default process 0
      listens on every interface at `coordinator_address`'s port.
    slice_index: JAX's multi-slice TPU option; must be None.
    partition_index: JAX's option for several partitions; must be None.
    process_addresses: Instead of the coordinator: `host:port` of every
      process, in process order; each process listens on its own. The same
      list in every process.
    backend: 'cpu', 'gpu' or 'tpu'; None picks TPU, then GPU, then CPU.
    heartbeat_timeout: tfspmd's earlier name of `heartbeat_timeout_seconds`.

  Raises:
    RuntimeError: If called twice, or after TensorFlow started its devices.
    TimeoutError: If some process did not join within
      `initialization_timeout`; the message names it. This process's
      TensorFlow runtime cannot be initialized again: restart it.
    ValueError, TypeError: For an incomplete or inconsistent description
      (in every process at once where the processes disagree on it), or
      processes with different numbers of devices.
    OSError: In process 0, if the coordinator's port is taken.

  Example:
    Two processes on one host, each with 4 logical CPU devices
    (`TFSPMD_NUM_CPU_DEVICES=4`), run the same program; process 1 passes
    `process_id=1`:

      tfspmd.distributed.initialize(
          coordinator_address="localhost:9000", num_processes=2,
          process_id=0)

    Once TensorFlow has started its devices, it is too late:

    >>> import tensorflow as tf, tfspmd
    >>> _ = tfspmd.pmap(lambda x: x)(tf.range(2))
    >>> tfspmd.distributed.initialize()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: tfspmd.distributed.initialize() came too late: ...
  """
  global _cluster, _shutdown_timeout_s
  with _lock:
    if _cluster is not None:
      raise RuntimeError(
          f"tfspmd.distributed.initialize() was already called in this "
          f"process (process {_cluster.process_id} of "
          f"{_cluster.num_processes}); call it once.")
    heartbeat_timeout = _heartbeat_timeout(heartbeat_timeout,
                                           heartbeat_timeout_seconds)
    _check_jax_only_options(cluster_detection_method, slice_index,
                            partition_index)
    if shutdown_timeout_seconds is None:
      shutdown_timeout_seconds = initialization_timeout
    for name, value in (("initialization_timeout", initialization_timeout),
                        ("heartbeat_timeout_seconds", heartbeat_timeout),
                        ("shutdown_timeout_seconds",
                         shutdown_timeout_seconds)):
      # Not infinite: every wait must end, and TensorFlow takes milliseconds
      # as an int.
      if isinstance(value, bool) or not isinstance(value, (int, float)) or (
          not 0 < value < math.inf):
        raise ValueError(
            f"tfspmd.distributed.initialize: `{name}` must be a positive, "
            f"finite number of seconds, got {value!r}.")
    if num_processes is not None:
      _check_num_processes(num_processes)
    if coordinator_address is not None:
      cluster_lib.split_address(coordinator_address, "coordinator_address")
    if coordinator_bind_address is not None:
      cluster_lib.split_address(coordinator_bind_address,
                                "coordinator_bind_address")
    platform = devices_lib.resolve_backend(backend)
    if (process_addresses is None and
        not cluster_lib.lists_addresses(os.environ)):
      if (coordinator_address is None and num_processes is None and
          process_id is None and platform != "tpu" and
          cluster_detection_method != "deactivate"):
        launched = launchers.detect(os.environ)
        if launched is not None:
          coordinator_address = launched.coordinator_address
          num_processes = launched.num_processes
          process_id = launched.process_id
      if coordinator_address is not None and num_processes not in (None, 1):
        process_id = cluster_lib.process_id_of(
            process_id, num_processes, f"num_processes={num_processes}",
            False, os.environ)
        _check_devices_not_started()
        process_addresses = rendezvous.exchange_addresses(
            coordinator_address, num_processes, process_id,
            initialization_timeout, bind_address=coordinator_bind_address)
        coordinator_address = None  # the exchange's, not a DTensor server's
    cluster = cluster_lib.resolve(
        coordinator_address, num_processes, process_id, process_addresses,
        on_tpu=platform == "tpu")
    gpus = (None if local_device_ids is None else
            _local_gpus(platform, local_device_ids))
    _check_devices_not_started()
    if gpus is not None:
      tf.config.set_visible_devices(gpus, "GPU")
    if platform == "gpu":
      # DTensor's NCCL collectives, one logical device per physical GPU.
      os.environ.setdefault(NCCL_ENV, "1")
    if cluster.num_processes > 1:
      os.environ.update({
          cluster_lib.JOBS_ENV: ",".join(cluster.addresses),
          cluster_lib.CLIENT_ID_ENV: str(cluster.process_id),
          cluster_lib.NUM_CLIENTS_ENV: str(cluster.num_processes),
          cluster_lib.JOB_NAME_ENV: cluster.job_name,
      })
      tf_internal.configure_coordination_service(
          f"/job:{cluster.job_name}/replica:0/task:0",
          register_timeout_s=initialization_timeout,
          heartbeat_timeout_s=heartbeat_timeout,
          shutdown_timeout_s=shutdown_timeout_seconds)
    try:
      # The coordination service is configured above, with timeouts.
      dtensor.initialize_accelerator_system(
          platform.upper(), enable_coordination_service=False)
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError) as e:
      raise TimeoutError(_join_timeout_message(
          cluster, str(e), initialization_timeout)) from e
    if cluster.num_processes > 1:
      _check_same_device_counts(cluster, platform)
    _cluster = cluster
    _shutdown_timeout_s = shutdown_timeout_seconds


def _heartbeat_timeout(heartbeat_timeout, heartbeat_timeout_seconds):
  """The heartbeat timeout, under JAX's name or tfspmd's earlier one."""
  if heartbeat_timeout is None:
    return heartbeat_timeout_seconds
  if heartbeat_timeout_seconds != 100:
    raise TypeError(
        f"tfspmd.distributed.initialize: give `heartbeat_timeout_seconds` "
        f"(JAX's name) or `heartbeat_timeout` (its earlier name), not both; "
        f"got {heartbeat_timeout_seconds!r} and {heartbeat_timeout!r}.")
  return heartbeat_timeout


def _check_jax_only_options(cluster_detection_method, slice_index,
                            partition_index):
  """Raises for JAX's options that TensorFlow's runtime has nothing for."""
  if cluster_detection_method not in _DETECTION_METHODS:
    raise ValueError(
        f"tfspmd.distributed.initialize: `cluster_detection_method` must be "
        f"None (read SLURM's or Open MPI's variables) or 'deactivate', got "
        f"{cluster_detection_method!r}. There is no 'mpi4py': under mpirun "
        f"Open MPI's variables are read with None; otherwise pass "
        f"coordinator_address, num_processes and process_id.")
  for name, value in (("slice_index", slice_index),
                      ("partition_index", partition_index)):
    if value is not None:
      raise ValueError(
          f"tfspmd.distributed.initialize: `{name}` must be None, got "
          f"{value!r}: DTensor's runtime numbers processes only, with no "
          f"slices or partitions. Give every process its process_id.")


def shutdown() -> None:
  """Waits for the other processes to reach `shutdown`, then leaves them.

  As `jax.distributed.shutdown`: it does nothing unless `initialize` ran.
  It waits for this process's pending work, then for every process to call
  `shutdown` (up to `initialize`'s `shutdown_timeout_seconds`), so no
  process exits while another still computes with it. TensorFlow's runtime
  stays up until the process exits (it cannot be restarted in a process):
  afterwards `is_initialized()` is False and `initialize` cannot be called
  again.

  Raises:
    TimeoutError: If some process did not call `shutdown` in time; the
      message names it.

  Example:
    >>> import tfspmd
    >>> tfspmd.distributed.shutdown()  # not initialized: nothing to do
    >>> tfspmd.distributed.is_initialized()
    False
  """
  global _cluster
  with _lock:
    if _cluster is None:
      return
    tf_internal.wait_for_pending_ops()
    me = _cluster.process_id
    if _cluster.num_processes > 1:
      tf_internal.publish(f"tfspmd/shutdown/{me}", "1")
      _wait_for_keys("tfspmd/shutdown", range(_cluster.num_processes))
      # The coordination service these keys live in runs in process 0: it
      # leaves last, once every other process has read them (else a
      # process still reading meets a closed connection).
      if me == 0:
        _wait_for_keys("tfspmd/shutdown/read", range(1, _cluster.num_processes))
      else:
        try:
          tf_internal.publish(f"tfspmd/shutdown/read/{me}", "1")
        except tf.errors.UnavailableError:
          # Process 0 leaves as soon as this key lands, and its service
          # may close the connection before its reply to the insert comes.
          pass
    _cluster = None


def _wait_for_keys(prefix, processes):
  """Reads `prefix/k` for each process k, each within the shutdown timeout."""
  for other in processes:
    try:
      tf_internal.read_published(f"{prefix}/{other}", _shutdown_timeout_s)
    except tf.errors.DeadlineExceededError:
      raise TimeoutError(
          f"tfspmd.distributed.shutdown: {_cluster.describe([other])} "
          f"did not call shutdown within shutdown_timeout_seconds="
          f"{_shutdown_timeout_s} (this is process {_cluster.process_id}). "
          f"Every process calls it at the end of the same program.") from None


def _check_num_processes(num_processes):
  if isinstance(num_processes, bool) or not isinstance(num_processes, int):
    raise TypeError(
        f"tfspmd.distributed.initialize: `num_processes` must be an int, got "
        f"{type(num_processes).__name__} {num_processes!r}; write "
        f"num_processes=int(...) if it comes from a string.")
  if num_processes < 1:
    raise ValueError(
        f"tfspmd.distributed.initialize: `num_processes` must be a positive "
        f"int, got {num_processes!r}.")


def _check_same_device_counts(cluster, platform):
  """Raises unless every process has as many devices of `platform`.

  A pmap maps over as many devices in every process (DTensor's meshes and
  `tfspmd.devices()` number them process by process); with other counts the
  first collective would fail inside TensorFlow, naming group sizes. Once
  joined, TensorFlow lists every process's devices, so no exchange is needed.
  """
  per_process = collections.Counter(
      tf.DeviceSpec.from_string(device.name).task
      for device in tf.config.list_logical_devices(platform.upper()))
  counts = [per_process.get(p, 0) for p in range(cluster.num_processes)]
  if len(set(counts)) == 1:
    return
  listed = ", ".join(f"process {p} has {n}" for p, n in enumerate(counts))
  how = {
      "cpu": f"the same {devices_lib.NUM_CPU_DEVICES_ENV} in every "
             f"process's environment (or tfspmd.set_num_cpu_devices)",
      "gpu": "as many GPUs to every process (local_device_ids or "
             "CUDA_VISIBLE_DEVICES)",
      "tpu": "every host of the slice its chips",
  }[platform]
  raise ValueError(
      f"tfspmd.distributed.initialize: the processes have different numbers "
      f"of {platform.upper()} devices: {listed}. A pmap maps over as many "
      f"devices in every process: give {how}, and restart every process.")


def _check_devices_not_started():
  if tf_internal.devices_initialized():
    raise RuntimeError(
        "tfspmd.distributed.initialize() came too late: TensorFlow has "
        "already started its devices (a TensorFlow op ran, or "
        "tfspmd.devices() or a pmap was called). Call it first thing "
        "after importing tfspmd.")


def is_initialized() -> bool:
  """True once `initialize` has succeeded in this process.

  Example:
    >>> import tfspmd
    >>> tfspmd.distributed.is_initialized()
    False
  """
  return _cluster is not None


def _local_gpus(platform, local_device_ids):
  """The physical GPUs `local_device_ids` picks, checked."""
  if platform != "gpu":
    raise ValueError(
        f"tfspmd.distributed.initialize: `local_device_ids` picks physical "
        f"GPUs, but the platform is {platform!r}. For CPU devices, set "
        f"{devices_lib.NUM_CPU_DEVICES_ENV} or call "
        f"tfspmd.set_num_cpu_devices; a TPU host uses all its chips.")
  gpus = tf.config.list_physical_devices("GPU")
  ids = list(local_device_ids)
  bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < len(gpus)]
  if bad or not ids or len(set(ids)) != len(ids):
    raise ValueError(
        f"tfspmd.distributed.initialize: `local_device_ids` must be distinct "
        f"indices of this host's {len(gpus)} GPU(s), got {ids!r}.")
  return [gpus[i] for i in ids]


def _tasks_named(message, cluster):
  """The process indices TensorFlow's `message` names, other than this one."""
  found = {int(t) for t in re.findall(r"/task:(\d+)", message)}
  for port in re.findall(r"ipv[46]:\S+?:(\d+): Failed to connect", message):
    found.update(p for p, address in enumerate(cluster.addresses)
                 if address.rsplit(":", 1)[1] == port)
  found.discard(cluster.process_id)
  return sorted(p for p in found if p < cluster.num_processes)


def _join_timeout_message(cluster, message, timeout):
  listed = message.split("timed out task names:", 1)
  missing = _tasks_named(listed[1], cluster) if len(listed) > 1 else []
  if not missing and cluster.process_id != 0:
    missing = [0]  # The coordinator never answered this process.
  who = cluster.describe(missing) if missing else "some process"
  return (
      f"tfspmd.distributed.initialize: {who} did not join within "
      f"initialization_timeout={timeout}s (this is process "
      f"{cluster.process_id} of {cluster.num_processes}, addresses from "
      f"{cluster.source}). Start every process with the same addresses, or "
      f"give slow starters a longer initialization_timeout. This process "
      f"cannot initialize again: restart it. TensorFlow said: "
      f"{_first_line(message)}")


def check_same_program(describe):
  """Raises unless every process traced the same program at this point.

  Each process publishes a description of every program it traces (the
  function, the mesh's devices, the global shapes and dtypes), numbered in
  the order traced, and reads the other processes' description of the same
  number. Processes that call pmaps in different orders, or give them
  different devices= lists, would otherwise run collectives that happen to
  fit on the wrong values. It costs one exchange per trace, none per call:
  an order that changes after every program is traced is not seen.

  Args:
    describe: Returns this process's description of the program just
      traced; called only with several processes (it walks the program).

  Raises:
    ValueError: If another process traced a different program.
    PeerFailedError: If another process exited or stopped answering first.
  """
  global _programs_traced
  if _cluster is None or _cluster.num_processes == 1:
    return
  description = describe()
  with _lock:
    number = _programs_traced
    _programs_traced += 1
  me = _cluster.process_id
  tf_internal.publish(f"tfspmd/program/{number}/{me}", description)
  for other in range(_cluster.num_processes):
    if other == me:
      continue
    theirs = _published_by_peer(f"tfspmd/program/{number}/{other}", other)
    if theirs != description:
      raise ValueError(
          f"The processes disagree on this pmapped call: the pmapped program "
          f"number {number + 1} of process {me} is {description}, that of "
          f"process {other} is {theirs}. Every process must call the same "
          f"pmaps in the same order, with the same devices= list, mapped "
          f"size, per-device shapes and dtypes (docs/multiprocess.md).")


def _published_by_peer(key, peer):
  """What the process `peer` published under `key`, waiting while it lives.

  A peer may reach the same point much later (it loads its data first), so
  the wait has no deadline of its own, as a collective has none; between
  looks it probes the peer, and a peer that is gone fails the wait.
  """
  task = f"/job:{_cluster.job_name}/replica:0/task:{peer}"
  while True:
    try:
      return tf_internal.read_published(key, _POLL_S)
    except tf.errors.DeadlineExceededError:
      pass
    try:
      tf_internal.check_peer_alive(task, _POLL_S)
    except tf.errors.OpError as e:
      raise PeerFailedError(
          f"{_cluster.describe([peer])} exited or stopped answering while "
          f"process {_cluster.process_id} waited for it to trace the same "
          f"pmapped program: it finished early, called fewer pmaps, or "
          f"failed. Every process must call the same pmaps in the same "
          f"order. TensorFlow said: {type(e).__name__}: "
          f"{_first_line(str(e))}") from e


def raise_peer_failure(error):
  """Raises the clear error for a TensorFlow `error` of a multi-process run.

  `PeerFailedError` for a lost peer (an `UnavailableError` or
  `DeadlineExceededError`) or one that finished its program while this one
  waited on it; `ValueError` for processes that called one pmap with
  different mapped sizes, shapes or dtypes, or different pmaps, which
  TensorFlow reports in terms of collective groups and instances; and
  `RuntimeError` for a call cancelled because such an error came first in
  another process. Returns otherwise, for the caller to handle `error`.
  """
  if (_cluster is None or _cluster.num_processes == 1 or
      not isinstance(error, tf.errors.OpError)):
    return
  message = str(error)
  restart = ("This process's collective runtime is aborted: restart every "
             "process.")
  said = f"TensorFlow said: {type(error).__name__}: {_first_line(message)}"
  disagreement = _disagreement(message)
  if disagreement:
    raise ValueError(
        f"The processes disagree on this pmapped call: {disagreement}. Every "
        f"process must call the same pmaps in the same order, each passing "
        f"its own part of the mapped axis with the same size, per-device "
        f"shapes and dtypes as the others (docs/multiprocess.md). {restart} "
        f"{said}") from error
  if isinstance(error, tf.errors.CancelledError):
    raise RuntimeError(
        f"Process {_cluster.process_id}'s part of this pmapped call was "
        f"cancelled: a collective of it failed in another process first "
        f"(its error says why; most often the processes passed different "
        f"mapped sizes, shapes or dtypes, or called different pmaps). "
        f"{restart} {said}") from error
  finished = "Shutdown barrier has failed" in message
  if not finished and not isinstance(
      error, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError)):
    return
  failed = _tasks_named(message, _cluster)
  if not failed and "CoordinationService/Heartbeat" in message:
    failed = [0]  # The coordinator, which receives the heartbeats, is gone.
  who = _cluster.describe(failed) if failed else "a peer process"
  if finished:
    raise PeerFailedError(
        f"{who} finished its program while process {_cluster.process_id} "
        f"waited on it in a collective: it never called this pmap. Every "
        f"process must call the same pmaps in the same order. {restart} "
        f"{said}") from error
  raise PeerFailedError(
      f"{who} exited or stopped answering while process "
      f"{_cluster.process_id} waited on it in a collective. {restart} "
      f"{said}") from error


def _disagreement(message):
  """How processes differed, from TensorFlow's collective `message`, or None."""
  sizes = re.search(r"joining a group with size ?(\d+), but that group has "
                    r"size ?(\d+)", message)
  if sizes:
    return (f"one process's call spans {sizes.group(1)} devices, another's "
            f"{sizes.group(2)} (different mapped sizes, devices= lists or "
            f"device counts)")
  shapes = re.search(r"expected shape (\[[^\]]*\]) but another member in "
                     r"the group expected shape (\[[^\]]*\])", message)
  if shapes:
    return (f"a collective's per-device shape is {shapes.group(1)} in one "
            f"process and {shapes.group(2)} in another (different argument "
            f"shapes)")
  kinds = re.search(r"expected type (\d+) and data_type (\d+) but got type "
                    r"(\d+) and data_type (\d+)", message)
  if kinds:
    expected_kind, expected, got_kind, got = (int(k) for k in kinds.groups())
    if expected_kind != got_kind:
      return ("the processes ran different collectives at one point (they "
              "called different pmaps, or in another order)")
    return (f"a collective's dtype differs between processes "
            f"({_dtype_name(expected)} in one, {_dtype_name(got)} in another, "
            f"as the collective runs them: different argument dtypes)")
  return None


def _dtype_name(enum):
  try:
    return tf.dtypes.as_dtype(enum).name
  except TypeError:
    return f"TensorFlow DataType {enum}"


def _first_line(message):
  """The first line of TensorFlow's `message`, without the function's name."""
  return re.sub(r"^\{\{function_node [^}]*\}\}\s*", "",
                message.strip()).splitlines()[0]


multiprocess_hooks.install(raise_peer_failure, check_same_program)
