"""Autoguides that follow the plate structure of hierarchical models (drop-ins for ``AutoNormal``)."""

from pyro_hier.guides.amortized import AutoAmortizedBranchGuide
from pyro_hier.guides.base import HierarchicalGuide
from pyro_hier.guides.branch import AutoBranchGuide

__all__ = ["AutoAmortizedBranchGuide", "AutoBranchGuide", "HierarchicalGuide"]
