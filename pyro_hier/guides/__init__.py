"""Autoguides that follow the plate structure of hierarchical models (drop-ins for ``AutoNormal``)."""

from pyro_hier.guides.amortized import AutoAmortizedBranchGuide
from pyro_hier.guides.base import HierarchicalGuide
from pyro_hier.guides.branch import AutoBranchGuide
from pyro_hier.guides.hvm import AutoHierarchicalVM
from pyro_hier.guides.pavi import AutoPlateAmortizedFlow

__all__ = [
    "AutoAmortizedBranchGuide",
    "AutoBranchGuide",
    "AutoHierarchicalVM",
    "AutoPlateAmortizedFlow",
    "HierarchicalGuide",
]
