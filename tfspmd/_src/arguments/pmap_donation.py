"""Donated arguments: checked before a call, freed after it.

A `ShardedArray` passed at a position of `donate_argnums` is deleted once
the call returns (unless the call returned it), as JAX frees a donated
buffer; using it again raises `donated_argument_error`.
"""

from tfspmd._src.runtime.sharded_array import ShardedArray
from tfspmd._src.trees import tree


def check_positions(donate_argnums, count):
  """Raises unless every donated position is among `count` positional args."""
  for num in donate_argnums:
    if not -count <= num < count:
      raise ValueError(
          f"pmapped function has donate_argnums={donate_argnums}, but was "
          f"called with only {count} positional argument(s), so argument "
          f"{num} cannot be donated. Pass every donated argument "
          f"positionally, or drop it from donate_argnums.")


def delete_donated(donate_argnums, args, results):
  """Deletes the `ShardedArray` leaves of the donated `args` not in `results`."""
  kept = {id(r) for r in results}
  for num in donate_argnums:
    position = num + len(args) if num < 0 else num
    if 0 <= position < len(args):
      for leaf in tree.flatten(args[position])[0]:
        if isinstance(leaf, ShardedArray) and id(leaf) not in kept:
          leaf.delete()


def donated_argument_error(path):
  return RuntimeError(
      f"pmapped function argument {path} is a ShardedArray that was donated "
      f"to an earlier call (donate_argnums), which deleted it. Pass that "
      f"call's result instead, or do not donate an argument you use again.")
