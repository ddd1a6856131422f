"""The core layer: what every layer may use. Every private TensorFlow name
(`tf_internal`), settings, error translation, and small helpers.
"""
