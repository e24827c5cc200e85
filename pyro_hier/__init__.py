"""pyro-hier: fast, accurate inference for large hierarchical Pyro models.

The flow is one way: model → :mod:`pyro_hier.structure` (plates, sites, parents, observed data) → guide family →
ELBO or estimator. Test problems with exact answers live in :mod:`pyro_hier.problems`.
"""

from pyro_hier.errors import StructureError
from pyro_hier.guides import (
    AutoAmortizedBranchGuide,
    AutoBranchGuide,
    AutoHierarchicalVM,
    AutoPlateAmortizedFlow,
)
from pyro_hier.infer import MPImportance, TensorTooLargeError
from pyro_hier.local_data import GroupedData
from pyro_hier.optim import IterateAverage
from pyro_hier.plates import PlateCall, capture_plates
from pyro_hier.structure import LatentSite, ModelStructure, ObservedSite, PlateInfo, inspect_model

__version__ = "0.1.0"

__all__ = [
    "AutoAmortizedBranchGuide",
    "AutoBranchGuide",
    "AutoHierarchicalVM",
    "AutoPlateAmortizedFlow",
    "GroupedData",
    "IterateAverage",
    "LatentSite",
    "MPImportance",
    "ModelStructure",
    "ObservedSite",
    "PlateCall",
    "PlateInfo",
    "StructureError",
    "TensorTooLargeError",
    "__version__",
    "capture_plates",
    "inspect_model",
]
