"""Inference algorithms built on the model structure: :class:`MPImportance` (massively parallel importance
sampling)."""

from pyro_hier.infer.factor_graph import TensorTooLargeError
from pyro_hier.infer.mp_importance import MPImportance

__all__ = ["MPImportance", "TensorTooLargeError"]
