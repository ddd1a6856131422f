"""What the single-process runtime asks of the multi-process one.

Placing, running and reading arrays must turn a lost peer's TensorFlow
error into a clear one and check that every process traced the same
program, but only once several processes run. The runtime calls these
hooks; `distributed` installs its implementations when it is imported, so
a program that never starts several processes never loads the
coordination, rendezvous and launcher code, and the runtime's modules do
not depend on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

_raise_peer_failure: Callable[[BaseException], None] | None = None
_check_same_program: Callable[[Callable[[], Any]], None] | None = None


def install(raise_peer_failure: Callable[[BaseException], None],
            check_same_program: Callable[[Callable[[], Any]], None]) -> None:
  """Sets the multi-process implementations of the hooks below."""
  global _raise_peer_failure, _check_same_program
  _raise_peer_failure = raise_peer_failure
  _check_same_program = check_same_program


def raise_peer_failure(error: BaseException) -> None:
  """Raises the clear error for `error` if it is a peer's failure.

  Returns otherwise, for the caller to handle `error`.
  """
  if _raise_peer_failure is not None:
    _raise_peer_failure(error)


@contextlib.contextmanager
def peer_failures() -> Iterator[None]:
  """Turns a peer's TensorFlow error inside the block into a clear one.

  A multi-process call returns before its collectives finish, so the error
  can surface where its results are read.
  """
  try:
    yield
  except tf.errors.OpError as e:
    raise_peer_failure(e)
    raise


def check_same_program(describe: Callable[[], Any]) -> None:
  """Raises unless every process traced the same program at this point.

  `describe` is called only when several processes run.
  """
  if _check_same_program is not None:
    _check_same_program(describe)
