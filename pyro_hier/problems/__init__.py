"""Test problems with exact (or long-run reference) answers, shared by tests, benchmarks, tutorials and the demo.

Each factory returns a :class:`Problem`: the Pyro model, its data as ``args``/``kwargs``, and what is known:

============================  ==========================================  ==========================================
factory                       model                                       known
============================  ==========================================  ==========================================
:func:`synthetic_regression`  Agrawal & Domke's hierarchical regression   exact evidence and posterior, N up to 1e5
:func:`gaussian_random_effects` PAVI's GRE (two nested plates)            exact evidence and posterior
:func:`three_level`           plate in plate in plate, linear-Gaussian    exact evidence and posterior
:func:`crossed_effects`       rows × cols crossed random effects          exact evidence and posterior
:func:`discrete_mixture`      tiny discrete-latent model                  exact posterior by enumeration
:func:`eight_schools`         Rubin's eight schools (centred or not)      posteriordb reference moments
:func:`radon_mn`              Minnesota radon, county effects             Inference Gym reference moments
:func:`movielens`             MovieLens user preferences over genres      held-out ratings (10% of each user's)
:func:`occupancy`             sites × species × visits, latent presence   exact evidence and posterior (quadrature)
============================  ==========================================  ==========================================
"""

from pyro_hier.problems.base import Moments, Problem
from pyro_hier.problems.count_pair import CountPairProblem, count_pair, count_pair_model
from pyro_hier.problems.crossed import crossed_effects, crossed_model
from pyro_hier.problems.discrete import DiscreteProblem, discrete_mixture, discrete_model
from pyro_hier.problems.eight_schools import eight_schools
from pyro_hier.problems.gre import GREProblem, gaussian_random_effects, gre_model
from pyro_hier.problems.linear_gaussian import LinearGaussianProblem, LinearGaussianSystem
from pyro_hier.problems.movielens import (
    HeldOutLikelihood,
    MovieLensProblem,
    heldout_log_likelihood,
    movielens,
    movielens_model,
    predictive_log_likelihood,
    ratings_problem,
    split_by_group,
)
from pyro_hier.problems.occupancy import OccupancyProblem, occupancy, occupancy_model
from pyro_hier.problems.radon import RADON_SITE_SHAPES, radon_mn
from pyro_hier.problems.regression import RegressionProblem, regression_model, synthetic_regression
from pyro_hier.problems.three_level import three_level, three_level_model

__all__ = [
    "RADON_SITE_SHAPES",
    "CountPairProblem",
    "DiscreteProblem",
    "GREProblem",
    "HeldOutLikelihood",
    "LinearGaussianProblem",
    "LinearGaussianSystem",
    "Moments",
    "MovieLensProblem",
    "OccupancyProblem",
    "Problem",
    "RegressionProblem",
    "count_pair",
    "count_pair_model",
    "crossed_effects",
    "crossed_model",
    "discrete_mixture",
    "discrete_model",
    "eight_schools",
    "gaussian_random_effects",
    "gre_model",
    "heldout_log_likelihood",
    "movielens",
    "movielens_model",
    "occupancy",
    "occupancy_model",
    "predictive_log_likelihood",
    "radon_mn",
    "ratings_problem",
    "regression_model",
    "split_by_group",
    "synthetic_regression",
    "three_level",
    "three_level_model",
]
