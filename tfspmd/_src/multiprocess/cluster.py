"""Which processes run the program together: from arguments or the environment.

DTensor's multi-client runtime needs the `host:port` of every process, in
process order, and this process's index among them; process 0 runs the
coordination service. They come, first found first, from the arguments of
`tfspmd.distributed.initialize`, from DTensor's own variables
(`DTENSOR_JOBS`, `DTENSOR_CLIENT_ID`, `DTENSOR_JOB_NAME`, checked against
`DTENSOR_NUM_CLIENTS` if set), from `TF_CONFIG` (as the platforms that start
TensorFlow jobs set it; `launchers.tf_config`), or from a Cloud TPU VM
(`TPU_WORKER_HOSTNAMES` and `TPU_WORKER_ID`, else the VM's metadata server).
Nothing found means one process.
"""

import dataclasses
import os
import urllib.request

from tfspmd._src.multiprocess import launchers

JOBS_ENV = "DTENSOR_JOBS"
CLIENT_ID_ENV = "DTENSOR_CLIENT_ID"
NUM_CLIENTS_ENV = "DTENSOR_NUM_CLIENTS"
JOB_NAME_ENV = "DTENSOR_JOB_NAME"
TPU_HOSTNAMES_ENV = "TPU_WORKER_HOSTNAMES"
TPU_WORKER_ID_ENV = "TPU_WORKER_ID"
# The port every TPU VM host's process listens on when the addresses come from
# the TPU environment (hostnames only); JAX's coordinator uses the same one.
DEFAULT_TPU_PORT = 8476
DEFAULT_JOB_NAME = "worker"
_METADATA_URL = ("http://metadata.google.internal/computeMetadata/v1/"
                 "instance/attributes/")


@dataclasses.dataclass(frozen=True)
class Cluster:
  """The processes of one program.

  Attributes:
    addresses: `host:port` of each process, in process order; the first is
      the coordinator.
    process_id: This process's index in `addresses`.
    job_name: The TensorFlow job name every process's devices carry.
    source: Where the description came from, for messages.
  """
  addresses: tuple
  process_id: int
  job_name: str
  source: str

  @property
  def num_processes(self):
    return len(self.addresses)

  def describe(self, processes):
    """`'processes 1 (h:4242), 3 (h:4244)'`, or `'process 1 (h:4242)'`."""
    listed = ", ".join(f"{p} ({self.addresses[p]})" for p in processes)
    return f"process {listed}" if len(processes) == 1 else f"processes {listed}"


def resolve(coordinator_address=None, num_processes=None, process_id=None,
            process_addresses=None, on_tpu=False, environ=None):
  """The `Cluster` the arguments and the environment describe.

  Args:
    coordinator_address: `host:port` of process 0, or None.
    num_processes: The number of processes, or None.
    process_id: This process's index, or None.
    process_addresses: `host:port` of every process, in order, or None.
    on_tpu: Whether this is a TPU host (then the Cloud TPU environment is
      consulted).
    environ: The environment to read (default `os.environ`).

  Returns:
    A `Cluster`.

  Raises:
    ValueError: If the description is incomplete or inconsistent.

  Example:
    >>> from tfspmd._src.multiprocess import cluster
    >>> c = cluster.resolve(process_addresses=["h0:8476", "h1:8476"],
    ...                     process_id=1, environ={})
    >>> c.num_processes, c.process_id, c.job_name
    (2, 1, 'worker')
    >>> cluster.resolve(environ={}).addresses
    ('localhost',)
  """
  environ = os.environ if environ is None else environ
  addresses, source = _addresses(coordinator_address, num_processes,
                                 process_addresses, on_tpu, environ)
  if source == launchers.TF_CONFIG_ENV and process_id is None:
    process_id = launchers.tf_config(environ)[1]
  if addresses is None:
    if coordinator_address is not None and num_processes is None:
      raise ValueError(
          f"tfspmd.distributed.initialize: coordinator_address="
          f"{coordinator_address!r} was given without num_processes: pass "
          f"num_processes= and process_id= too, so the processes can find "
          f"each other through the coordinator.")
    if num_processes not in (None, 1) or process_id not in (None, 0):
      raise ValueError(
          f"tfspmd.distributed.initialize: num_processes={num_processes}, "
          f"process_id={process_id}, but neither a coordinator address nor "
          f"process addresses were given. Pass coordinator_address="
          f"'host:port' (process 0's) with num_processes and process_id, or "
          f"process_addresses=['host:port', ...] (one per process, process "
          f"0 first), or set {JOBS_ENV} in every process.")
    return Cluster(addresses=("localhost",),
                   process_id=0, job_name="localhost", source="one process")
  for address in addresses:
    split_address(address, f"every process address (from {source})")
  repeated = sorted({a for a in addresses if addresses.count(a) > 1})
  if repeated:
    # Two processes cannot serve on one port; one would never join.
    raise ValueError(
        f"tfspmd.distributed.initialize: {source} lists {repeated} more than "
        f"once: {list(addresses)}. Give every process its own 'host:port'.")
  if coordinator_address is not None and coordinator_address != addresses[0]:
    raise ValueError(
        f"tfspmd.distributed.initialize: coordinator_address="
        f"{coordinator_address!r} is not process 0's address "
        f"{addresses[0]!r} ({source}); the coordinator is process 0.")
  if num_processes is not None and num_processes != len(addresses):
    raise ValueError(
        f"tfspmd.distributed.initialize: num_processes={num_processes}, but "
        f"{source} lists {len(addresses)} process address(es): "
        f"{list(addresses)}.")
  declared = environ.get(NUM_CLIENTS_ENV)
  if declared and declared != str(len(addresses)):
    raise ValueError(
        f"{NUM_CLIENTS_ENV}={declared}, but {source} lists {len(addresses)} "
        f"process address(es): {list(addresses)}.")
  process_id = process_id_of(process_id, len(addresses), source, on_tpu,
                             environ)
  return Cluster(addresses=tuple(addresses), process_id=process_id,
                 job_name=environ.get(JOB_NAME_ENV, DEFAULT_JOB_NAME),
                 source=source)


def _addresses(coordinator_address, num_processes, process_addresses, on_tpu,
               environ):
  """The addresses and where they came from, or (None, None) for one process."""
  if process_addresses is not None:
    if isinstance(process_addresses, str):
      raise TypeError(
          f"tfspmd.distributed.initialize: `process_addresses` must be a list "
          f"of 'host:port' strings, one per process, got the string "
          f"{process_addresses!r}.")
    addresses = list(process_addresses)
    if not addresses:
      raise ValueError("tfspmd.distributed.initialize: `process_addresses` is "
                       "empty; give one 'host:port' per process.")
    return addresses, "process_addresses"
  if environ.get(JOBS_ENV):
    return environ[JOBS_ENV].split(","), JOBS_ENV
  configured = launchers.tf_config(environ)
  if configured is not None:
    return list(configured[0]), launchers.TF_CONFIG_ENV
  if on_tpu:
    hosts = _tpu_hostnames(environ)
    if hosts:
      port = (int(coordinator_address.rsplit(":", 1)[1])
              if coordinator_address else DEFAULT_TPU_PORT)
      return [f"{host}:{port}" for host in hosts], "the Cloud TPU VM"
  return None, None


def lists_addresses(environ):
  """Whether `environ` lists every process's address (DTENSOR_JOBS, TF_CONFIG).

  Then no launcher's coordinator is needed to exchange them.
  """
  return (bool(environ.get(JOBS_ENV)) or
          launchers.tf_config(environ) is not None)


def process_id_of(process_id, count, source, on_tpu, environ):
  """This process's index among `count`, from the argument or the environment."""
  if process_id is None:
    found = environ.get(CLIENT_ID_ENV)
    if found is None and on_tpu:
      found = environ.get(TPU_WORKER_ID_ENV) or _tpu_metadata(
          "agent-worker-number")
    if found is None:
      if count == 1:
        return 0
      raise ValueError(
          f"tfspmd.distributed.initialize: {source} lists {count} processes "
          f"but nothing says which one this is: pass process_id=, or set "
          f"{CLIENT_ID_ENV}.")
    try:
      process_id = int(found)
    except ValueError:
      raise ValueError(
          f"{CLIENT_ID_ENV} must be an integer, got {found!r}.") from None
  if isinstance(process_id, bool) or not isinstance(process_id, int):
    raise TypeError(
        f"tfspmd.distributed.initialize: `process_id` must be an int, got "
        f"{type(process_id).__name__} {process_id!r}.")
  if not 0 <= process_id < count:
    raise ValueError(
        f"tfspmd.distributed.initialize: process_id={process_id} is out of "
        f"range for the {count} processes of {source}; it must be in "
        f"[0, {count}).")
  return process_id


def split_address(address, what):
  """`(host, port)` of a `'host:port'` string, or the error naming `what`.

  Checked before any process waits on the address: a URL, a missing port or
  one out of range would otherwise only show as a process that never joins,
  after the whole `initialization_timeout`.

  Args:
    address: The address as given.
    what: Which argument or variable it came from, for the message.

  Returns:
    `(host, port)`, the port an int.

  Raises:
    TypeError: If `address` is not a str.
    ValueError: If it is not `host:port` with a port in 1..65535.

  Example:
    >>> split_address("10.0.0.1:1234", "coordinator_address")
    ('10.0.0.1', 1234)
  """
  if not isinstance(address, str):
    raise TypeError(
        f"tfspmd.distributed.initialize: {what} must be a 'host:port' "
        f"string, got {type(address).__name__} {address!r}, such as "
        f"'host0:1234'.")
  host, _, port = address.rpartition(":")
  if (not host or "/" in host or not port.isdigit() or
      not 0 < int(port) < 65536):
    raise ValueError(
        f"tfspmd.distributed.initialize: {what} must be 'host:port', got "
        f"{address!r}: a host name or IP address, ':', and a port in "
        f"1..65535, with no scheme (such as 'host0:1234').")
  return host, int(port)


def _tpu_hostnames(environ):
  """The TPU VM hosts of the slice, in worker order, or None."""
  if environ.get(TPU_HOSTNAMES_ENV):
    return environ[TPU_HOSTNAMES_ENV].split(",")
  endpoints = _tpu_metadata("worker-network-endpoints")
  if not endpoints:
    return None
  # Entries are `<id>:<port>:<ip>`: the host is the last field.
  return [entry.split(":")[-1] for entry in endpoints.split(",")]


def _tpu_metadata(key):
  """A Cloud TPU VM metadata attribute, or None off Google Cloud."""
  request = urllib.request.Request(_METADATA_URL + key,
                                   headers={"Metadata-Flavor": "Google"})
  try:
    with urllib.request.urlopen(request, timeout=5) as response:
      return response.read().decode("utf-8").strip() or None
  except OSError:
    return None
