"""Exceptions raised by pyro-hier. Every message names the site or plate at fault and what to do about it."""

__all__ = ["StructureError"]


class StructureError(ValueError):
    """The model has a structure (plates, sites, sizes) that a pyro-hier guide or estimator cannot handle."""
