"""The programs layer: the mapped functions and their call paths. The compiled
path (trace once per signature, run), a pmap inside another's trace or the
user's `tf.function`, gradients around a call, several steps per call, and debug
mode (one thread per device).
"""
