"""The cluster a launcher started this process in: SLURM, Open MPI, TF_CONFIG.

As `jax.distributed.initialize()` with no arguments: under `srun` or
`mpirun` every process finds the coordinator (the first host of the job,
a port derived from the job id, so every process computes the same one),
the number of processes and its own index in the launcher's variables.
Platforms that start TensorFlow jobs (Vertex AI, Kubeflow's TFJob) set
`TF_CONFIG` instead, which lists every process's address.
"""

import json
import re
from typing import NamedTuple

from absl import logging

# Ports in the top 4096 of the range, from the job id, as JAX picks them.
_PORT_SPAN = 2 ** 12
_PORT_BASE = 65535 - _PORT_SPAN + 1

_logged = set()


class LaunchedJob(NamedTuple):
  """What a launcher's variables say of the job this process is in."""
  coordinator_address: str
  num_processes: int
  process_id: int
  launcher: str


def detect(environ):
  """The `LaunchedJob` a launcher started this process in, or None.

  Example:
    >>> detect({"SLURM_PROCID": "1", "SLURM_NTASKS": "4",
    ...         "SLURM_STEP_NODELIST": "node[007-010],gpu2",
    ...         "SLURM_JOB_ID": "123"})
    LaunchedJob(coordinator_address='node007:61563', num_processes=4,
                process_id=1, launcher='SLURM')
    >>> detect({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
    ...         "OMPI_MCA_orte_hnp_uri": "1406140416.0;tcp://10.1.2.3,"
    ...                                  "172.17.0.1:43213"})
    LaunchedJob(coordinator_address='10.1.2.3:61440', num_processes=2,
                process_id=0, launcher='Open MPI')
    >>> detect({}) is None
    True
  """
  found = _slurm(environ) or _open_mpi(environ)
  if found is not None and found.launcher not in _logged:
    _logged.add(found.launcher)
    logging.info("tfspmd.distributed: %s job: coordinator %s, %d processes, "
                 "this is process %d.", found.launcher,
                 found.coordinator_address, found.num_processes,
                 found.process_id)
  return found


def _port(job_id):
  return _PORT_BASE + int(job_id) % _PORT_SPAN


def _slurm(environ):
  if "SLURM_PROCID" not in environ or "SLURM_NTASKS" not in environ:
    return None
  nodes = environ.get("SLURM_STEP_NODELIST") or environ.get(
      "SLURM_JOB_NODELIST")
  job_id = environ.get("SLURM_JOB_ID")
  if not nodes or not job_id:
    raise ValueError(
        "tfspmd.distributed.initialize: SLURM_PROCID is set but "
        "SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST) and SLURM_JOB_ID are "
        "not: start the processes with srun, or pass coordinator_address, "
        "num_processes and process_id.")
  host = first_host(nodes)
  return LaunchedJob(f"{host}:{_port(job_id)}", int(environ["SLURM_NTASKS"]),
                     int(environ["SLURM_PROCID"]), "SLURM")


def first_host(nodelist):
  """The first host of a SLURM node list: 'node[007-010],b' -> 'node007'.

  Example:
    >>> first_host("localhost"), first_host("gpu[2,5-6]x,cpu1")
    ('localhost', 'gpu2x')
  """
  match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist)
  prefix, ranges, suffix = match.groups()
  if not ranges:
    return prefix + suffix
  first = re.split(r"[,-]", ranges)[0]
  return prefix + first + suffix


def _open_mpi(environ):
  if ("OMPI_COMM_WORLD_RANK" not in environ or
      "OMPI_COMM_WORLD_SIZE" not in environ):
    return None
  uri = environ.get("OMPI_MCA_orte_hnp_uri")
  match = re.match(r"(\d+)[.;].*?tcp6?://\[?([^,;:\]]+)", uri or "")
  if not match:
    raise ValueError(
        f"tfspmd.distributed.initialize: OMPI_COMM_WORLD_RANK is set but "
        f"OMPI_MCA_orte_hnp_uri ({uri!r}) does not name the launcher's job "
        f"and host: start the processes with mpirun, or pass "
        f"coordinator_address, num_processes and process_id.")
  job_id, host = match.groups()
  return LaunchedJob(f"{host}:{_port(job_id)}",
                     int(environ["OMPI_COMM_WORLD_SIZE"]),
                     int(environ["OMPI_COMM_WORLD_RANK"]), "Open MPI")


TF_CONFIG_ENV = "TF_CONFIG"
# The jobs whose tasks run the program together, in process order, as
# tf.distribute's multi-worker strategies number them (the chief first).
_TF_CONFIG_JOBS = ("chief", "worker")


def _task_index(index):
  """TF_CONFIG's task index as an int, as TensorFlow reads it: '1' and 1.0 too.

  Anything else (1.5, 'one', True) is returned as it is, for the range check
  to name.
  """
  if isinstance(index, str) and index.strip().isdigit():
    return int(index)
  if isinstance(index, float) and index.is_integer():
    return int(index)
  return index


def tf_config(environ):
  """`(addresses, process_id)` from `TF_CONFIG`, or None where it is not set.

  As `tf.distribute.cluster_resolver.TFConfigClusterResolver` reads it: the
  processes are the cluster's "chief" task, if any, then its "worker" tasks,
  and this process is the one `task` names. Other jobs ("ps", "evaluator")
  do not run the program with them.

  Example:
    >>> tf_config({"TF_CONFIG": '{"cluster": {"worker": ["w0:2222", '
    ...            '"w1:2222"], "chief": ["c:2222"]}, '
    ...            '"task": {"type": "worker", "index": 1}}'})
    (('c:2222', 'w0:2222', 'w1:2222'), 2)
    >>> tf_config({}) is None
    True
  """
  text = environ.get(TF_CONFIG_ENV, "").strip()
  if not text:
    return None
  try:
    config = json.loads(text)
  except ValueError as e:
    raise ValueError(
        f"tfspmd.distributed.initialize: {TF_CONFIG_ENV} is not JSON ({e}): "
        f"it must be like {{\"cluster\": {{\"worker\": [\"host:port\", "
        f"...]}}, \"task\": {{\"type\": \"worker\", \"index\": 0}}}}."
    ) from None
  cluster = config.get("cluster", {}) if isinstance(config, dict) else None
  if not isinstance(cluster, dict):
    raise ValueError(
        f"tfspmd.distributed.initialize: {TF_CONFIG_ENV} must be a JSON "
        f"object with a \"cluster\" object, got {text!r}.")
  addresses = []
  for job in _TF_CONFIG_JOBS:
    tasks = cluster.get(job, [])
    if isinstance(tasks, dict):  # {"0": "host:port", ...}, as TF accepts
      tasks = [tasks[k] for k in sorted(tasks, key=int)]
    if not isinstance(tasks, list):
      raise ValueError(
          f"tfspmd.distributed.initialize: {TF_CONFIG_ENV}'s {job!r} job "
          f"must be a list of 'host:port' strings, got {tasks!r}.")
    addresses.extend(tasks)
  if not addresses:
    if any(job in cluster for job in _TF_CONFIG_JOBS):
      raise ValueError(
          f"tfspmd.distributed.initialize: {TF_CONFIG_ENV}'s cluster lists "
          f"no \"chief\" or \"worker\" task ({cluster!r}): list every "
          f"process's 'host:port' in them.")
    return None
  task = config.get("task") or {}
  kind, index = task.get("type"), _task_index(task.get("index", 0))
  if kind not in _TF_CONFIG_JOBS:
    raise ValueError(
        f"tfspmd.distributed.initialize: {TF_CONFIG_ENV}'s task is "
        f"{task!r}, but the processes that run a pmap together are the "
        f"cluster's \"chief\" and \"worker\" tasks: give this process "
        f"\"task\": {{\"type\": \"worker\" (or \"chief\"), \"index\": ...}}, "
        f"or do not call tfspmd.distributed.initialize in it.")
  jobs = [len(cluster.get(job, [])) for job in _TF_CONFIG_JOBS]
  if isinstance(index, bool) or not isinstance(index, int):
    raise ValueError(
        f"tfspmd.distributed.initialize: {TF_CONFIG_ENV}'s task index must "
        f"be a whole number (as an int, a string of digits or a float such "
        f"as 1.0), got {index!r}.")
  if not 0 <= index < jobs[_TF_CONFIG_JOBS.index(kind)]:
    raise ValueError(
        f"tfspmd.distributed.initialize: {TF_CONFIG_ENV}'s task index "
        f"{index!r} is out of range for its {kind!r} job of "
        f"{jobs[_TF_CONFIG_JOBS.index(kind)]} task(s).")
  process_id = index + (jobs[0] if kind == "worker" else 0)
  if TF_CONFIG_ENV not in _logged:
    _logged.add(TF_CONFIG_ENV)
    logging.info("tfspmd.distributed: %s: %d processes, this is process %d.",
                 TF_CONFIG_ENV, len(addresses), process_id)
  return tuple(addresses), process_id
