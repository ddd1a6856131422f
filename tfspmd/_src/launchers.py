"""The cluster a launcher started this process in: SLURM or Open MPI.

As `jax.distributed.initialize()` with no arguments: under `srun` or
`mpirun` every process finds the coordinator (the first host of the job,
a port derived from the job id, so every process computes the same one),
the number of processes and its own index in the launcher's variables.
"""

import re

from absl import logging

# Ports in the top 4096 of the range, from the job id, as JAX picks them.
_PORT_SPAN = 2 ** 12
_PORT_BASE = 65535 - _PORT_SPAN + 1

_logged = set()


def detect(environ):
  """`(coordinator_address, num_processes, process_id, launcher)` or None.

  Example:
    >>> detect({"SLURM_PROCID": "1", "SLURM_NTASKS": "4",
    ...         "SLURM_STEP_NODELIST": "node[007-010],gpu2",
    ...         "SLURM_JOB_ID": "123"})
    ('node007:61563', 4, 1, 'SLURM')
    >>> detect({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
    ...         "OMPI_MCA_orte_hnp_uri": "1406140416.0;tcp://10.1.2.3,"
    ...                                  "172.17.0.1:43213"})
    ('10.1.2.3:61440', 2, 0, 'Open MPI')
    >>> detect({}) is None
    True
  """
  found = _slurm(environ) or _open_mpi(environ)
  if found is not None and found[3] not in _logged:
    _logged.add(found[3])
    logging.info("tfspmd.distributed: %s job: coordinator %s, %d processes, "
                 "this is process %d.", found[3], found[0], found[1], found[2])
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
  return (f"{host}:{_port(job_id)}", int(environ["SLURM_NTASKS"]),
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
  return (f"{host}:{_port(job_id)}", int(environ["OMPI_COMM_WORLD_SIZE"]),
          int(environ["OMPI_COMM_WORLD_RANK"]), "Open MPI")
