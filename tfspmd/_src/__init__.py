"""Private implementation of tfspmd. Nothing here is public API: import from `tfspmd`."""
