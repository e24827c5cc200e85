"""MPImportance on models written with a flat plate that gathers group effects by an index (a[..., group]): brute
force over all K^n index combinations (with both kinds of subsampling, and an index chain), the same estimate as the
nested formulation, exact posteriors, radon as written, and the refusals."""

import itertools
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer.autoguide import AutoNormal

from pyro_hier.errors import StructureError
from pyro_hier.infer import MPImportance
from pyro_hier.plates import gathered_rows
from pyro_hier.problems import LinearGaussianSystem

f64 = torch.float64
Normal = dist.Normal

# ------------------------------------------------------------------------------------------------- two levels
# mu ~ N(0, 1); z_g ~ N(mu, 1) (plate "groups"); y_i ~ N(z_{group_i} + 0.3 x_i, 1) (flat plate "obs")
GROUP = torch.tensor([2, 0, 1, 2, 2, 0, 3, 1])
Y = torch.tensor([0.8, -0.4, 1.1, 1.5, 0.2, 0.1, -0.9, 0.6], dtype=f64)
XC = torch.tensor([0.5, -1.0, 0.3, 0.0, 1.2, -0.2, 0.7, 0.4], dtype=f64)
G = 4
OFF = torch.tensor([0.3, 1.0, -0.6, 0.4], dtype=f64)


def flat_model(y, subsample=None, obs_subsample=None):
    mu = pyro.sample("mu", Normal(y.new_zeros(()), 1.0))
    with pyro.plate("groups", G, dim=-1, subsample=subsample):
        z = pyro.sample("z", Normal(mu, 1.0))
    sel = gathered_rows(GROUP, G, subsample)
    rows = sel.rows if obs_subsample is None else obs_subsample
    group = sel.group if obs_subsample is None else GROUP[obs_subsample]
    take = (lambda t: t) if rows is None else (lambda t: t[rows])
    with pyro.plate("obs", len(GROUP), dim=-1, subsample=rows), poutine.scale(scale=sel.scale):
        pyro.sample("y", Normal(z[..., group] + 0.3 * take(XC.to(y)), 1.0), obs=take(y))


def flat_guide(y, subsample=None, obs_subsample=None):
    """q(mu) q(z_g | mu): each z sample is drawn given the mu sample of the same index."""
    mu = pyro.sample("mu", Normal(y.new_tensor(0.4), 0.8))
    with pyro.plate("groups", G, dim=-1, subsample=subsample) as idx:
        pyro.sample("z", Normal(0.5 * mu + OFF.to(y)[idx], 0.7))


def p_normal(loc, scale, value):
    return Normal(torch.as_tensor(loc, dtype=f64), scale).log_prob(value)


def all_combinations(K, n):
    return torch.tensor(list(itertools.product(range(K), repeat=n)), dtype=torch.long)


def two_level_table(mp, guide, present, obs_weight):
    """Log weight of every (k_mu, k_z of each element of ``present``) combination, elements given as (position in
    the call, group); ``obs_weight[i]`` multiplies observation i's log density (0: absent)."""
    K = mp.num_samples
    s = mp.proposal_samples
    mu, z = s["mu"].reshape(K), s["z"].reshape(K, -1)
    combos = all_combinations(K, 1 + len(present))
    km = combos[:, 0]
    lw = p_normal(0.0, 1.0, mu[km]) - (p_normal(0.4, 0.8, mu[km]) if guide else p_normal(0.0, 1.0, mu[km]))
    for j, (pos, g) in enumerate(present):
        kz = combos[:, 1 + j]
        zz = z[kz, pos]
        lw = lw + p_normal(mu[km], 1.0, zz)
        lw = lw - (Normal(0.5 * mu[kz] + OFF[g], 0.7).log_prob(zz) if guide else p_normal(mu[kz], 1.0, zz))
        for i in range(len(GROUP)):
            if int(GROUP[i]) == g and obs_weight[i] != 0:
                lw = lw + obs_weight[i] * p_normal(zz + 0.3 * XC[i], 1.0, Y[i])
    lw = lw - (1 + len(present)) * math.log(K)
    return lw.reshape((K,) * (1 + len(present))), mu, z


def marginal(w, axis):
    return w.sum(tuple(d for d in range(w.dim()) if d != axis))


def check_brute_force(mp, lw, mu, z, columns, atol=1e-6):
    """``columns[j]``: the axis of ``lw`` holding element j of z's plate in the call."""
    log_p = lw.logsumexp(tuple(range(lw.dim())))
    assert abs(float(mp.get_log_normalizer()) - float(log_p)) < atol
    w = (lw - log_p).exp()
    assert torch.allclose(mp.marginal_weights("mu"), marginal(w, 0), atol=atol)
    wz = torch.stack([marginal(w, a) for a in columns], -1)
    assert torch.allclose(mp.marginal_weights("z"), wz, atol=atol)
    assert torch.allclose(mp.moments("mu"), (marginal(w, 0) * mu).sum(), atol=atol)
    assert torch.allclose(mp.moments("z"), (wz * z).sum(0), atol=atol)
    assert torch.allclose(mp.moments("z", torch.exp), (wz * z.exp()).sum(0), atol=atol)
    return log_p, w


@pytest.mark.parametrize("proposal", ["guide", "prior"])
def test_brute_force_gathered(proposal):
    guide = flat_guide if proposal == "guide" else None
    K = 3
    mp = MPImportance(flat_model, guide, num_samples=K).run(Y)
    lw, mu, z = two_level_table(mp, guide, [(g, g) for g in range(G)], [1.0] * len(GROUP))
    log_p, _ = check_brute_force(mp, lw, mu, z, [1 + g for g in range(G)])
    combos = all_combinations(K, 1 + G)
    lp = mp.log_prob_indices({"mu": combos[:, 0], "z": combos[:, 1:]})
    assert torch.allclose(lp, lw.reshape(-1) - log_p, atol=1e-6)


def test_float32_gathered_model_matches_the_float64_brute_force():
    K = 3
    pyro.set_rng_seed(1)
    mp = MPImportance(flat_model, flat_guide, num_samples=K).run(Y.float())
    assert mp.get_log_normalizer().dtype == torch.float32 and mp.moments("z").dtype == torch.float32
    as64 = type(
        "S", (), {"num_samples": K, "proposal_samples": {k: v.double() for k, v in mp.proposal_samples.items()}}
    )
    lw, _, _ = two_level_table(as64, True, [(g, g) for g in range(G)], [1.0] * len(GROUP))
    log_p = lw.logsumexp(tuple(range(lw.dim())))
    assert abs(float(mp.get_log_normalizer()) - float(log_p)) < 1e-4
    wz = torch.stack([marginal((lw - log_p).exp(), 1 + g) for g in range(G)], -1)
    assert torch.allclose(mp.marginal_weights("z").double(), wz, atol=1e-5)


def test_brute_force_groups_subsampled_with_gathered_rows():
    """2 of 4 groups with their rows (gathered_rows: the rows' site scaled to G/m = 2, so their weight is 1 and the
    groups' product is raised to 2): the explicit sum in which each present group appears twice with the same
    samples."""
    K = 3
    idx = torch.tensor([2, 0])
    mp = MPImportance(flat_model, flat_guide, num_samples=K).run(Y, subsample=idx)
    present = [(0, 2), (1, 0), (0, 2), (1, 0)]
    lw, mu, z = two_level_table(mp, True, present, [1.0] * len(GROUP))
    _, w = check_brute_force(mp, lw, mu, z, [1, 2])
    joint = w.sum((3, 4))  # (k_mu, first copies), the second copies summed out
    combos = all_combinations(K, 3)
    lp = mp.log_prob_indices({"mu": combos[:, 0], "z": combos[:, 1:]})
    assert torch.allclose(lp, joint.reshape(-1).log(), atol=1e-6)


def test_brute_force_observations_subsampled_alone():
    """4 of the 8 rows, every group present: each row's log density is weighted by M/B = 2 inside its group's sum
    over samples (the plate of rows is summed into the groups)."""
    K = 3
    rows = torch.tensor([0, 2, 5, 6])
    mp = MPImportance(flat_model, flat_guide, num_samples=K).run(Y, obs_subsample=rows)
    weight = [2.0 if i in rows.tolist() else 0.0 for i in range(len(GROUP))]
    lw, mu, z = two_level_table(mp, True, [(g, g) for g in range(G)], weight)
    log_p, _ = check_brute_force(mp, lw, mu, z, [1 + g for g in range(G)])
    combos = all_combinations(K, 1 + G)
    lp = mp.log_prob_indices({"mu": combos[:, 0], "z": combos[:, 1:]})
    assert torch.allclose(lp, lw.reshape(-1) - log_p, atol=1e-6)


# ------------------------------------------------------------------------------------------------- an index chain
# homes -> counties -> states, the homes also reading their state directly (through the chain)
CS = torch.tensor([1, 0, 1])  # state of each county
CH = torch.tensor([0, 2, 1, 2, 0])  # county of each home
YH = torch.tensor([0.5, 1.4, -0.3, 0.9, 0.1], dtype=f64)
OFF_S = torch.tensor([0.2, -0.3], dtype=f64)
OFF_C = torch.tensor([0.1, -0.2, 0.4], dtype=f64)


def chain_model(y):
    mu = pyro.sample("mu", Normal(y.new_zeros(()), 1.0))
    with pyro.plate("states", 2, dim=-1):
        s = pyro.sample("s", Normal(mu, 1.0))
    with pyro.plate("counties", 3, dim=-1):
        c = pyro.sample("c", Normal(s[..., CS], 1.0))
    with pyro.plate("homes", 5, dim=-1):
        pyro.sample("y", Normal(c[..., CH] + 0.5 * s[..., CS][..., CH], 1.0), obs=y)


def chain_guide(y):
    mu = pyro.sample("mu", Normal(y.new_tensor(0.2), 0.9))
    with pyro.plate("states", 2, dim=-1):
        s = pyro.sample("s", Normal(0.5 * mu + OFF_S, 0.8))
    with pyro.plate("counties", 3, dim=-1):
        pyro.sample("c", Normal(0.5 * s[..., CS] + OFF_C, 0.7))


def chain_table(mp, guide):
    K = mp.num_samples
    smp = mp.proposal_samples
    mu, s, c = smp["mu"].reshape(K), smp["s"].reshape(K, 2), smp["c"].reshape(K, 3)
    combos = all_combinations(K, 6)
    km, ks, kc = combos[:, 0], combos[:, 1:3], combos[:, 3:]
    m = mu[km]
    lw = p_normal(0.0, 1.0, m) - (p_normal(0.2, 0.9, m) if guide else p_normal(0.0, 1.0, m))
    sv = torch.stack([s[ks[:, j], j] for j in range(2)], -1)
    cv = torch.stack([c[kc[:, i], i] for i in range(3)], -1)
    for j in range(2):
        lw = lw + p_normal(m, 1.0, sv[:, j])
        drawn_given = mu[ks[:, j]]  # each s sample was drawn given the mu sample of the same index
        lw = lw - (Normal(0.5 * drawn_given + OFF_S[j], 0.8) if guide else Normal(drawn_given, 1.0)).log_prob(sv[:, j])
    for i in range(3):
        lw = lw + p_normal(sv[:, CS[i]], 1.0, cv[:, i])
        drawn_given = s[kc[:, i], CS[i]]  # and each c sample given the sample of its state with its index
        lw = lw - (Normal(0.5 * drawn_given + OFF_C[i], 0.7) if guide else Normal(drawn_given, 1.0)).log_prob(cv[:, i])
    for h in range(5):
        lw = lw + p_normal(cv[:, CH[h]] + 0.5 * sv[:, CS[CH[h]]], 1.0, YH[h])
    lw = lw - 6 * math.log(K)
    return lw.reshape((K,) * 6), mu, s, c


@pytest.mark.parametrize("proposal", ["guide", "prior"])
def test_brute_force_index_chain(proposal):
    guide = chain_guide if proposal == "guide" else None
    K = 3
    mp = MPImportance(chain_model, guide, num_samples=K).run(YH)
    lw, mu, s, c = chain_table(mp, guide)
    log_p = lw.logsumexp(tuple(range(6)))
    assert abs(float(mp.get_log_normalizer()) - float(log_p)) < 1e-6
    w = (lw - log_p).exp()
    ws = torch.stack([marginal(w, 1 + j) for j in range(2)], -1)
    wc = torch.stack([marginal(w, 3 + i) for i in range(3)], -1)
    assert torch.allclose(mp.marginal_weights("mu"), marginal(w, 0), atol=1e-6)
    assert torch.allclose(mp.moments("mu"), (marginal(w, 0) * mu).sum(), atol=1e-6)
    assert torch.allclose(mp.marginal_weights("s"), ws, atol=1e-6)
    assert torch.allclose(mp.marginal_weights("c"), wc, atol=1e-6)
    assert torch.allclose(mp.moments("s"), (ws * s).sum(0), atol=1e-6)
    assert torch.allclose(mp.moments("c", torch.exp), (wc * c.exp()).sum(0), atol=1e-6)
    combos = all_combinations(K, 6)  # the sampler draws each county given its own state's index
    lp = mp.log_prob_indices({"mu": combos[:, 0], "s": combos[:, 1:3], "c": combos[:, 3:]})
    assert torch.allclose(lp, lw.reshape(-1) - log_p, atol=1e-6)
    draws = mp.sample_posterior(4)
    assert draws["c"].shape == (4, 3) and draws["s"].shape == (4, 2)
    if proposal == "guide":  # drawn pairs (index of county 0's state, index of county 0) against their exact joint
        S = 3000
        idx = mp.sample_indices(S)
        pairs = torch.bincount(idx["s"][:, CS[0]] * K + idx["c"][:, 0], minlength=K * K).to(f64)
        joint = w.sum(tuple(d for d in range(6) if d not in (1 + int(CS[0]), 3))).reshape(-1)
        stat = ((pairs - S * joint) ** 2 / (S * joint)).sum()
        assert float(torch.special.gammaincc(torch.tensor((K * K - 1) / 2, dtype=f64), stat / 2)) > 1e-3


# ------------------------------------------------------------------------------------------------- chunks
def test_brute_force_chunked_groups_with_gathered_rows():
    """Chunks of 3 and 1 groups (the model opens each chunk's rows with gathered_rows): the same estimator as one
    pass over all groups, with shared samples of mu."""
    K = 3
    mp = MPImportance(flat_model, flat_guide, num_samples=K, chunk_plate="groups", chunk_size=3).run(Y)
    lw, mu, z = two_level_table(mp, True, [(g, g) for g in range(G)], [1.0] * len(GROUP))
    log_p, _ = check_brute_force(mp, lw, mu, z, [1 + g for g in range(G)])
    combos = all_combinations(K, 1 + G)
    lp = mp.log_prob_indices({"mu": combos[:, 0], "z": combos[:, 1:]})
    assert torch.allclose(lp, lw.reshape(-1) - log_p, atol=1e-6)


def test_chunking_a_gathered_plate_or_latents_in_one_is_refused():
    def by_rows(y, subsample=None):
        mu = pyro.sample("mu", Normal(y.new_zeros(()), 1.0))
        with pyro.plate("groups", G, dim=-1):
            z = pyro.sample("z", Normal(mu, 1.0))
        with pyro.plate("obs", len(GROUP), dim=-1, subsample=subsample) as i:
            pyro.sample("y", Normal(z[..., GROUP[i]], 1.0), obs=y[i])

    with pytest.raises(StructureError, match=r"chunk_plate 'obs' is gathered into plate 'groups'.*chunk 'groups'"):
        MPImportance(by_rows, num_samples=2, chunk_plate="obs", chunk_size=4).run(Y)

    def chain(y, subsample=None):
        with pyro.plate("states", 2, dim=-1, subsample=subsample) as i:
            s = pyro.sample("s", Normal(y.new_zeros(()), 1.0))
        sel = gathered_rows(CS, 2, i)
        with pyro.plate("counties", 3, dim=-1, subsample=sel.rows), poutine.scale(scale=sel.scale):
            pyro.sample("c", Normal(s[..., sel.group], 1.0))

    with pytest.raises(StructureError, match=r"latent sites \['c'\] lie in plates gathered into it"):
        MPImportance(chain, num_samples=2, chunk_plate="states", chunk_size=1).run(YH)


# ------------------------------------------------------------------------------------------------- the nested form
ROWS = [[i for i in range(len(GROUP)) if int(GROUP[i]) == g] for g in range(G)]
N_MAX = max(len(r) for r in ROWS)
PAD = torch.tensor([r + [0] * (N_MAX - len(r)) for r in ROWS]).T  # (N_MAX, G) row of each slot
MASK = torch.tensor([[j < len(r) for r in ROWS] for j in range(N_MAX)])


def nested_model(y, subsample=None, obs_subsample=None):
    """flat_model with each group's rows in a plate nested in the groups (padded, masked)."""
    mu = pyro.sample("mu", Normal(y.new_zeros(()), 1.0))
    with pyro.plate("groups", G, dim=-1):
        z = pyro.sample("z", Normal(mu, 1.0))
        with pyro.plate("slots", N_MAX, dim=-2):
            pyro.sample("y", Normal(z + 0.3 * XC[PAD], 1.0).mask(MASK), obs=y[PAD])


@pytest.mark.parametrize("proposal", ["guide", "prior"])
def test_gathered_and_nested_forms_give_the_same_estimate(proposal):
    guide = flat_guide if proposal == "guide" else None
    out = []
    for m in (flat_model, nested_model):
        pyro.set_rng_seed(7)
        mp = MPImportance(m, guide, num_samples=16).run(Y)
        out.append((mp.get_log_normalizer(), mp.moments("z").reshape(-1), mp.get_ESS("mu"), mp.proposal_samples["z"]))
    (lp_flat, z_flat, ess_flat, s_flat), (lp_nested, z_nested, ess_nested, s_nested) = out
    assert torch.equal(s_flat.reshape(16, G), s_nested.reshape(16, G))  # the same samples
    assert abs(float(lp_flat) - float(lp_nested)) < 1e-6
    assert torch.allclose(z_flat, z_nested, atol=1e-6) and torch.allclose(ess_flat, ess_nested, atol=1e-6)


# ------------------------------------------------------------------------------------------------- exact posterior
def test_exact_posterior_means_gathered_linear_gaussian():
    """mu ~ N(0, 1), z_g ~ N(mu, 1) for 6 groups, y_i ~ N(z_{g_i}, 0.5²) for ragged groups of 1 to 6 rows, written
    with a flat plate of rows; prior proposal, K = 400: posterior means within 4 sd/√ESS of the closed form."""
    g = torch.Generator().manual_seed(3)
    group = torch.repeat_interleave(torch.arange(6), torch.tensor([1, 2, 3, 4, 5, 6]))
    truth = torch.randn(6, generator=g, dtype=f64)
    y = truth[group] + 0.5 * torch.randn(len(group), generator=g, dtype=f64)

    def model(y):
        mu = pyro.sample("mu", Normal(y.new_zeros(()), 1.0))
        with pyro.plate("groups", 6, dim=-1):
            z = pyro.sample("z", Normal(mu, 1.0))
        with pyro.plate("rows", len(group), dim=-1):
            pyro.sample("y", Normal(z[..., group], 0.5), obs=y)

    L = 7
    W = torch.zeros(L, L, dtype=f64)
    W[1:, 0] = 1.0
    A = torch.zeros(len(group), L, dtype=f64)
    A[torch.arange(len(group)), 1 + group] = 1.0
    system = LinearGaussianSystem(
        torch.zeros(L, dtype=f64),
        W,
        torch.ones(L, dtype=f64),
        A,
        torch.full((len(group),), 0.25),
        sites={"mu": (), "z": (6,)},
    )
    exact = system.moments(y)
    pyro.set_rng_seed(0)
    mp = MPImportance(model, num_samples=400).run(y)
    for site in ("mu", "z"):
        z = (mp.moments(site) - exact[site].mean) / (exact[site].sd / mp.get_ESS(site).sqrt())
        assert z.abs().max() < 4, (site, z)
    assert abs(float(mp.get_log_normalizer()) - float(system.log_evidence(y))) < 1.0


# ------------------------------------------------------------------------------------------------- radon as written
def test_radon_as_written_runs_end_to_end():
    from pyro_hier.problems import radon_mn

    p = radon_mn(prior="halfnormal")
    pyro.set_rng_seed(0)
    mp = MPImportance(p.model, num_samples=8).run(*p.args, **p.kwargs)
    log_p = mp.get_log_normalizer()
    assert torch.isfinite(log_p)
    means = mp.moments("county_effect")
    assert means.shape == (85,) and bool(torch.isfinite(means).all())
    w = mp.marginal_weights("county_effect")
    assert w.shape == (8, 85) and torch.allclose(w.sum(0), torch.ones(85, dtype=f64), atol=1e-9)
    ess = mp.get_ESS("county_effect")
    assert bool(((ess >= 1 - 1e-9) & (ess <= 8 + 1e-9)).all())
    assert mp.sample_posterior(3)["county_effect"].shape == (3, 85)


# ------------------------------------------------------------------------------------------------- refusals
def test_crossed_plates_are_refused_with_the_guide_route():
    student, question = torch.tensor([0, 1, 2, 0, 1]), torch.tensor([0, 0, 1, 1, 2])
    y = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], dtype=f64)

    def model(y):
        with pyro.plate("students", 3, dim=-1):
            ability = pyro.sample("ability", Normal(y.new_zeros(()), 1.0))
        with pyro.plate("questions", 3, dim=-1):
            difficulty = pyro.sample("difficulty", Normal(y.new_zeros(()), 1.0))
        with pyro.plate("answers", 5, dim=-1):
            pyro.sample("y", dist.Bernoulli(logits=ability[..., student] - difficulty[..., question]), obs=y)

    with pytest.raises(StructureError, match=r"plate 'answers' reads elements of plates '\w+'.*crossed plates") as e:
        MPImportance(model, num_samples=4).run(y)
    assert "'students'" in str(e.value) and "'questions'" in str(e.value) and "AutoBranchGuide" in str(e.value)


def test_whole_plate_read_is_refused_naming_the_site_and_plate():
    def model(y):
        with pyro.plate("counties", 3, dim=-1):
            a = pyro.sample("a", Normal(y.new_zeros(()), 1.0))
        pyro.sample("total", Normal(a.sum(-1), 1.0), obs=y.sum())

    with pytest.raises(
        StructureError,
        match=r"site 'total' \(plates \[\]\) depends on samples drawn per element of "
        r"plate\(s\) \['counties'\].*in no plate but depends on the elements",
    ):
        MPImportance(model, num_samples=4).run(Y)


def test_index_computed_from_a_latent_is_refused_naming_the_site_and_plate():
    def model(y):
        with pyro.plate("components", 3, dim=-1):
            locs = pyro.sample("locs", Normal(y.new_zeros(()), 3.0))
        with pyro.plate("data", len(y), dim=-1):
            k = pyro.sample("k", dist.Categorical(torch.ones(3, dtype=f64) / 3))
            pyro.sample("y", Normal(locs[..., k], 1.0), obs=y)

    with pytest.raises(
        StructureError,
        match=r"site 'y' \(plates \['data'\]\) depends on samples drawn per element "
        r"of plate\(s\) \['components'\].*index computed from the latent site\(s\) \['k'\]",
    ):
        MPImportance(model, num_samples=4).run(Y)


def test_chain_read_that_disagrees_with_the_parent_is_refused():
    """A home reading a state other than its county's cannot be summed into its county."""
    wrong_state = CS[CH].clone()
    wrong_state[3] = 1 - wrong_state[3]

    def model(y):
        with pyro.plate("states", 2, dim=-1):
            s = pyro.sample("s", Normal(y.new_zeros(()), 1.0))
        with pyro.plate("counties", 3, dim=-1):
            c = pyro.sample("c", Normal(s[..., CS], 1.0))
        with pyro.plate("homes", 5, dim=-1):
            pyro.sample("y", Normal(c[..., CH] + s[..., wrong_state], 1.0), obs=y)

    with pytest.raises(
        StructureError,
        match=r"element 3 of plate 'homes' reads element \d of plate 'states'.*the state "
        r"of a home must be the state of its county",
    ):
        MPImportance(model, num_samples=2).run(YH)


def test_two_reads_of_one_plate_by_different_indices_are_refused():
    other = (GROUP + 1) % G

    def model(y):
        with pyro.plate("groups", G, dim=-1):
            z = pyro.sample("z", Normal(y.new_zeros(()), 1.0))
        with pyro.plate("obs", len(GROUP), dim=-1):
            pyro.sample("y", Normal(z[..., GROUP], 1.0), obs=y)
            pyro.sample("y2", Normal(z[..., other], 1.0), obs=y)

    with pytest.raises(StructureError, match=r"element 0 of plate 'obs' reads element 2 of plate 'groups' in site 'y'"):
        MPImportance(model, num_samples=2).run(Y)


def test_rows_that_read_no_group_are_exact():
    """Rows whose covariate is 0 read no element of the groups (the structure gives them index -1): their factor is
    the same for every sample, so any group may take it; the estimate is still the brute-force sum."""
    w = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=f64)

    def model(y):
        mu = pyro.sample("mu", Normal(y.new_zeros(()), 1.0))
        with pyro.plate("groups", G, dim=-1):
            z = pyro.sample("z", Normal(mu, 1.0))
        with pyro.plate("obs", len(GROUP), dim=-1):
            pyro.sample("y", Normal(z[..., GROUP] * w, 1.0), obs=y)

    K = 3
    mp = MPImportance(model, num_samples=K).run(Y)
    s = mp.proposal_samples
    mu, z = s["mu"].reshape(K), s["z"].reshape(K, G)
    combos = all_combinations(K, 1 + G)
    lw = torch.full((len(combos),), -(1 + G) * math.log(K), dtype=f64)
    for g in range(G):
        kz = combos[:, 1 + g]
        zz = z[kz, g]
        lw = lw + p_normal(mu[combos[:, 0]], 1.0, zz) - p_normal(mu[kz], 1.0, zz)  # prior proposal, diagonal
        lw = lw + sum(p_normal(zz * w[i], 1.0, Y[i]) for i in range(len(GROUP)) if int(GROUP[i]) == g)
    assert abs(float(mp.get_log_normalizer()) - float(lw.logsumexp(0))) < 1e-9


def test_a_model_that_indexes_its_groups_from_the_left_gets_the_fix_named():
    """``a[county]`` works when the model runs alone but not with MPImportance's samples in batch dims to the left
    (nor under Pyro's vectorised particles): Pyro's shape error comes with the cause and the fix."""
    county = torch.tensor([0, 1, 1, 2, 0])

    def model():
        with pyro.plate("counties", 3):
            a = pyro.sample("a", dist.Normal(0.0, 1.0))
        with pyro.plate("homes", 5):
            pyro.sample("y", dist.Normal(a[county], 1.0), obs=torch.zeros(5))

    with pytest.raises(ValueError, match=r"Shape mismatch(.|\n)*a\[\.\.\., idx\] instead of a\[idx\]"):
        MPImportance(model, num_samples=4).run()


def test_data_in_another_dtype_than_the_guide_gets_the_fix_named():
    """A float32 guide's samples meet float64 data in the model's matrix product: the error says so and names the fix,
    not the left-indexing hint of a shape error."""
    x = torch.randn(6, 2, dtype=torch.float64)

    def model(x):
        beta = pyro.sample("beta", dist.Normal(torch.zeros(2, dtype=x.dtype), 1.0).to_event(1))
        with pyro.plate("data", 6):
            pyro.sample("y", dist.Normal((x @ beta.unsqueeze(-1)).squeeze(-1), 1.0), obs=torch.zeros_like(x[:, 0]))

    guide = AutoNormal(model)
    guide(x.float())
    with pytest.raises(RuntimeError, match=r"(.|\n)*dtype of the guide's parameters(.|\n)*guide\.to\(torch\.float64\)"):
        MPImportance(model, guide, num_samples=4).run(x)
