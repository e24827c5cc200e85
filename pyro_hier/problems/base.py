"""The common surface of every test problem: data, a Pyro model, and what is known about its posterior."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Moments:
    """Posterior mean and standard deviation of one latent site, at the site's full (un-subsampled) shape."""

    mean: torch.Tensor
    sd: torch.Tensor


@dataclass
class Problem:
    """A Pyro model together with its data and what is known about its posterior.

    ``problem.model(*problem.args, **problem.kwargs)`` runs the model on all of its data. Models whose groups can be
    minibatched take a keyword ``subsample`` (a ``LongTensor`` of group indices) that they pass to their group plate
    as ``pyro.plate(..., subsample=subsample)``.

    What is known comes in two strengths:

    - ``log_evidence``: the exact ``log p(y)`` (``None`` when only reference moments are known);
    - ``moments``: per-site posterior :class:`Moments` — exact for the closed-form problems, long-run NUTS reference
      values (with ``reference`` naming their source) for the real-data ones.

    Example::

        from pyro_hier.problems import synthetic_regression
        p = synthetic_regression(num_groups=10)
        trace = pyro.poutine.trace(p.model).get_trace(*p.args, **p.kwargs)
        print(p.log_evidence, p.moments["theta"].mean)
    """

    name: str
    model: Callable
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    log_evidence: float | None = None
    moments: dict[str, Moments] = field(default_factory=dict)
    reference: str = ""
    #: how amortized guides see each group's data: ``local_features`` (covariates of the observations, nested in the
    #: group plate or gathering the groups by an index), ``local_data`` ({plate: GroupedData}) for ragged groups given
    #: by hand (see :class:`~pyro_hier.AutoAmortizedBranchGuide`)
    local_features: Callable | None = field(default=None, repr=False)
    local_data: dict | None = field(default=None, repr=False)

    @property
    def has_exact_evidence(self) -> bool:
        return self.log_evidence is not None
