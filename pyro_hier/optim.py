r"""Optimisation helpers: iterate averaging, and Adam that updates only the rows of per-element parameters a step
touched.

**Iterate averaging.** A stochastic-gradient run with a small learning rate ends wherever the last noisy gradients left
it: the final parameters :math:`\phi_T` scatter around the optimum :math:`\phi^\star` with a spread set by the gradient
noise, and in flat directions of the ELBO (a hierarchical scale in a funnel, say) that scatter is what dominates the
error of the posterior moments. Polyak–Ruppert averaging replaces :math:`\phi_T` by the mean of the last iterates,

.. math::

    \bar\phi = \frac{1}{n} \sum_{k=0}^{n-1} \phi_{T-k},

whose scatter shrinks like :math:`1/\sqrt{n}` when the iterates fluctuate around the optimum (Polyak & Juditsky,
1992). The average is taken over a module's ``torch.nn.Parameter`` values, which for Pyro's ``PyroParam`` are the
*unconstrained* values, so constrained parameters stay inside their support.

**Lazy Adam.** Per-element parameters (one row per group, :mod:`pyro_hier.sparse`) get a gradient only on the rows of
the minibatch. :class:`LazyAdam` and :class:`LazyClippedAdam` read those rows' sparse gradients and update only them,
so a step costs :math:`O(B)` in the minibatch, not :math:`O(N)` in the number of groups. Each row keeps its own step
count, and a row not in the minibatch is left as it is — its parameters, moments and step count — so that every row
follows exactly Adam on the subsequence of steps in which it was seen. (Dense Adam would instead keep moving such a row
with its decaying momentum, an update driven by a stale gradient; and its bias correction would count steps the row
never saw.) When every row is seen on every step, the result is the dense optimiser's to rounding.
``pyro_hier.optim.Adam`` and ``pyro_hier.optim.ClippedAdam`` wrap them for ``SVI`` like ``pyro.optim.Adam`` and
``pyro.optim.ClippedAdam``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from pyro.optim import PyroOptim

from pyro_hier.sparse import consume_sparse_grad, element_dims

__all__ = [
    "Adam",
    "ClippedAdam",
    "IterateAverage",
    "LazyAdam",
    "LazyClippedAdam",
    "LazyPyroOptim",
    "tail_average_update",
]


class IterateAverage:
    r"""Running mean of a module's parameters over the steps where :meth:`update` is called; :meth:`apply` writes
    it into the module.

    .. math::

        \bar\phi_n = \bar\phi_{n-1} + (\phi_n - \bar\phi_{n-1}) / n

    over every ``torch.nn.Parameter`` of the module (unconstrained values of ``PyroParam`` s). Call :meth:`update`
    after each optimisation step of the averaging window, typically the last quarter to half of the run, once the
    loss has stopped trending; then :meth:`apply` once. The set of parameters is fixed at the first :meth:`update`
    (autoguides create theirs on their first call, so start averaging after at least one step).

    Example::

        guide = AutoPlateAmortizedFlow(model, flow="affine", condition_on_ancestors=True)
        svi = SVI(model, guide, pyro.optim.ClippedAdam({"lr": 0.03}), Trace_ELBO(num_particles=64,
                  vectorize_particles=True))
        average = IterateAverage(guide)
        for step in range(6000):
            svi.step(data)
            if step >= 4500:
                average.update()
        average.apply()  # the guide now holds the mean of the last 1,500 iterates

    Reference: B. T. Polyak, A. B. Juditsky. *Acceleration of stochastic approximation by averaging.* SIAM Journal
    on Control and Optimization 30(4), 1992.

    :param module: the guide (any ``torch.nn.Module``) whose parameters are averaged.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"IterateAverage: expected a torch.nn.Module (e.g. an autoguide), got {type(module)}")
        self.module = module
        self.count = 0
        self._mean: dict[str, torch.Tensor] = {}

    def update(self) -> None:
        """Add the module's current parameters to the running mean."""
        params = dict(self.module.named_parameters())
        state = getattr(self.module, "state_parameters", None)  # a guide's gradient-free state is not an iterate
        if state is not None:
            skip = {id(p) for p in state().values()}
            params = {k: v for k, v in params.items() if id(v) not in skip}
        if not params:
            raise ValueError(
                "IterateAverage.update: the module has no parameters yet; autoguides create them on their first "
                "call, so call update() after an optimisation step"
            )
        with torch.no_grad():
            if self.count == 0:
                self._mean = {name: p.detach().clone() for name, p in params.items()}
            else:
                if params.keys() != self._mean.keys():
                    new = sorted(params.keys() - self._mean.keys())
                    gone = sorted(self._mean.keys() - params.keys())
                    raise ValueError(
                        f"IterateAverage.update: the module's parameters changed since averaging began (new: {new}, "
                        f"gone: {gone}); start averaging once the guide has seen every site and data source"
                    )
                for name, p in params.items():
                    mean = self._mean[name]
                    if mean.shape != p.shape:
                        raise ValueError(
                            f"IterateAverage.update: parameter {name!r} changed shape from {tuple(mean.shape)} to "
                            f"{tuple(p.shape)} since averaging began"
                        )
                    mean.add_(p.detach() - mean, alpha=1.0 / (self.count + 1))
        self.count += 1

    def apply(self) -> None:
        """Write the averaged parameters into the module (in place, so optimisers and Pyro's param store, which
        hold the same tensors, see them)."""
        if self.count == 0:
            raise ValueError("IterateAverage.apply: nothing to apply, update() was never called")
        params = dict(self.module.named_parameters())
        state = getattr(self.module, "state_parameters", None)  # a guide's gradient-free state is not an iterate
        if state is not None:
            skip = {id(p) for p in state().values()}
            params = {k: v for k, v in params.items() if id(v) not in skip}
        missing = sorted(self._mean.keys() - params.keys())
        if missing:
            raise ValueError(f"IterateAverage.apply: the module no longer has the parameters {missing}")
        with torch.no_grad():
            for name, mean in self._mean.items():
                params[name].copy_(mean)


@torch.no_grad()
def tail_average_update(
    average: torch.Tensor | Sequence[torch.Tensor],
    value: torch.Tensor | Sequence[torch.Tensor],
    count: int,
    fraction: float,
) -> None:
    r"""One step of an online tail average, in place: after the :math:`n`-th value :math:`\phi_n`,

    .. math:: \bar\phi_n = \bar\phi_{n-1} + \beta_n (\phi_n - \bar\phi_{n-1}),
              \qquad \beta_n = 1 / \max(1, f n),

    an exponential average whose memory grows with the run: about the last fraction :math:`f` of the values so far.
    Applied to the iterates of an optimiser with a decaying learning rate it is Polyak–Ruppert averaging of the run's
    tail (Polyak & Juditsky 1992) without knowing where the run ends (:class:`~pyro_hier.AutoBranchGuide` averages
    its global parameters so, from their gradient hooks, and uses the average outside training).

    Example::

        average = loc.detach().clone()
        for n in range(1, 101):
            ...  # an optimiser step on loc
            tail_average_update(average, loc, n, fraction=0.25)

    :param average: :math:`\bar\phi_{n-1}`, overwritten with :math:`\bar\phi_n`; or a sequence of such tensors
        (all updated in one fused operation: :class:`~pyro_hier.AutoPlateAmortizedFlow` averages every weight of its
        networks so).
    :param value: :math:`\phi_n` (a sequence matching ``average``'s).
    :param count: :math:`n \ge 1`.
    :param fraction: :math:`f \in (0, 1]`.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"tail_average_update: fraction must be in (0, 1], got {fraction!r}")
    beta = 1.0 / max(1.0, fraction * count)
    if isinstance(average, torch.Tensor):
        average.add_(value.detach().to(average.dtype) - average, alpha=beta)
        return
    averages = list(average)
    values = [v.detach().to(a.dtype) for a, v in zip(averages, value, strict=True)]
    if averages:
        torch._foreach_lerp_(averages, values, beta)


class LazyAdam(torch.optim.Optimizer):
    r"""Adam (as ``torch.optim.Adam``) that updates only the rows of per-element parameters a step touched.

    For a parameter that is not per-element (a global, a network weight) it is ``torch.optim.Adam``. A per-element
    parameter (one whose rows :func:`pyro_hier.sparse.select_elements` selects: the groups' locations, Cholesky
    factors, encodings) gets from the second step on a sparse gradient over the rows of the minibatch (the optimiser
    declares itself with :func:`pyro_hier.sparse.consume_sparse_grad`; the first backward ran before it existed and
    gave a dense gradient, whose all-zero rows are taken as not touched). With :math:`g_r` the gradient of touched
    row :math:`r` and :math:`t_r` the number of steps that touched it,

    .. math::

        m_r \leftarrow \beta_1 m_r + (1-\beta_1) g_r,\qquad v_r \leftarrow \beta_2 v_r + (1-\beta_2) g_r^2,\qquad
        \phi_r \leftarrow \phi_r - \frac{\eta}{1-\beta_1^{t_r}}\,
        \frac{m_r}{\sqrt{v_r/(1-\beta_2^{t_r})} + \epsilon},

    and a row not touched keeps :math:`\phi_r, m_r, v_r, t_r` (its momentum does not move it: see the module doc).
    Work and memory traffic per step are proportional to the touched rows. The step counts live in the state as
    ``step`` (one per row; a scalar for other parameters), so ``state_dict`` and Pyro's ``get_state`` round-trip.
    After stepping a per-element parameter whose gradient was dense, it sets that gradient to ``None``, so that the
    next backward starts a sparse one (Pyro's ``SVI`` would otherwise zero it densely and keep it dense).

    Use it with ``SVI`` through :func:`pyro_hier.optim.Adam`, or directly on ``guide.parameters()`` in a torch loop.
    Other optimisers keep working with the guides (they get dense gradients, as before), without the saving.

    Example::

        optim = pyro_hier.optim.Adam({"lr": 0.01})       # instead of pyro.optim.Adam({"lr": 0.01})
        svi = SVI(model, AutoBranchGuide(model), optim, Trace_ELBO())

    Reference: D. P. Kingma, J. Ba, *Adam: A Method for Stochastic Optimization*, ICLR 2015 (the lazy, row-wise
    update is the one of TensorFlow Addons' ``LazyAdam``, here with per-row bias correction).

    :param params: parameters or parameter groups.
    :param lr: learning rate :math:`\eta`.
    :param betas: :math:`(\beta_1, \beta_2)`.
    :param eps: :math:`\epsilon`.
    :param weight_decay: L2 penalty added to the gradient (of touched rows only, for per-element parameters).
    :param clip_norm: if given, every gradient entry is first clamped to ``[-clip_norm, clip_norm]``.
    :param lrd: the learning rate is multiplied by ``lrd`` at every step (before it is used), as in Pyro's
        ``ClippedAdam``.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        clip_norm: float | None = None,
        lrd: float = 1.0,
    ) -> None:
        if not (lr >= 0 and math.isfinite(lr)):
            raise ValueError(f"lr must be a non-negative number, got {lr!r}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if not eps >= 0:
            raise ValueError(f"eps must be non-negative, got {eps!r}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be non-negative, got {weight_decay!r}")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm must be positive or None, got {clip_norm!r}")
        if not 0 < lrd <= 1:
            raise ValueError(f"lrd must be in (0, 1], got {lrd!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, clip_norm=clip_norm, lrd=lrd)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            consume_sparse_grad(p, self)

    @torch.no_grad()
    def step(self, closure=None):
        """One step on every parameter with a gradient (sparse or dense)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            group["lr"] *= group["lrd"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                rows = element_dims(p)
                if p.grad.is_sparse:
                    if rows is None or p.grad.sparse_dim() != rows:
                        rows = p.grad.sparse_dim()
                    self._step_rows(group, p, rows)
                elif rows is not None:
                    self._step_rows(group, p, rows)
                    p.grad = None  # the next backward accumulates a sparse gradient
                else:
                    self._step_dense(group, p)
        return loss

    def decay(self) -> None:
        """What :meth:`step` does for parameters without a gradient: multiply the learning rate by ``lrd``.
        (:class:`LazyPyroOptim` calls it instead of :meth:`step` for them, without the per-call overhead of
        ``torch.optim.Optimizer.step``.)"""
        for group in self.param_groups:
            group["lr"] *= group["lrd"]

    # ---- the update, shared by the dense and the row-wise paths ---------------------------------------------------
    def _moments(self, group: dict, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor) -> None:
        beta1, beta2 = group["betas"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

    def _denominator(self, exp_avg_sq: torch.Tensor, bias_correction2: torch.Tensor | float, eps: float):
        if isinstance(bias_correction2, torch.Tensor):  # one per row, float64
            return (exp_avg_sq.sqrt() / bias_correction2.sqrt().to(exp_avg_sq.dtype)).add_(eps)
        return (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)

    def _step_size(self, lr: float, bias_correction1, bias_correction2):
        return lr / bias_correction1

    def _prepare(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        if group["clip_norm"] is not None:
            grad = grad.clamp(-group["clip_norm"], group["clip_norm"])
        if group["weight_decay"] != 0:
            grad = grad.add(p, alpha=group["weight_decay"])
        return grad

    def _step_dense(self, group: dict, p: torch.Tensor) -> None:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float64)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if state["step"].dim() != 0:
            raise RuntimeError(
                "LazyAdam: a parameter stepped row by row before now has a gradient that is neither sparse nor per "
                "element; keep one optimiser per kind of parameter"
            )
        grad = self._prepare(group, p, p.grad)
        state["step"] += 1
        t = float(state["step"])
        beta1, beta2 = group["betas"]
        self._moments(group, state["exp_avg"], state["exp_avg_sq"], grad)
        bias_correction1, bias_correction2 = 1 - beta1**t, 1 - beta2**t
        denom = self._denominator(state["exp_avg_sq"], bias_correction2, group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-self._step_size(group["lr"], bias_correction1, bias_correction2))

    def _step_rows(self, group: dict, p: torch.Tensor, rows: int) -> None:
        if not p.is_contiguous():
            raise RuntimeError("LazyAdam: per-element parameters must be contiguous")
        shape = p.shape[:rows]
        num_rows = math.prod(shape)
        flat_p = p.view(num_rows, -1)
        grad = p.grad
        if grad.is_sparse:
            index, values = _ravel(grad._indices(), shape), grad._values()
            # rows in increasing order (a minibatch's sorted indices read once) are what coalescing would give: it is
            # skipped for them (it sorts); otherwise duplicates are summed
            if not (grad.is_coalesced() or index.numel() < 2 or bool((index[1:] > index[:-1]).all())):
                grad = grad.coalesce()
                index, values = _ravel(grad.indices(), shape), grad.values()
            values = values.reshape(index.shape[0], -1)
        else:
            dense = grad.reshape(num_rows, -1)
            index = dense.ne(0).any(-1).nonzero().squeeze(-1)
            values = dense.index_select(0, index)
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.zeros(num_rows, dtype=torch.float64, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        elif state["step"].dim() == 0:  # stepped densely before (its rows were not known yet)
            state["step"] = state["step"].to(p.device).expand(num_rows).clone()
        if state["step"].shape != (num_rows,):
            raise RuntimeError(
                f"LazyAdam: the parameter's rows changed from {tuple(state['step'].shape)} to {num_rows}"
            )
        if index.numel() == 0:
            return
        if group["clip_norm"] is not None or group["weight_decay"] != 0:  # (the rows are read for weight decay only)
            rows_p = flat_p.index_select(0, index) if group["weight_decay"] != 0 else flat_p
            values = self._prepare(group, rows_p, values)
        steps = state["step"].index_select(0, index).add_(1)
        state["step"].index_copy_(0, index, steps)
        exp_avg_all = state["exp_avg"].view(num_rows, -1)
        exp_avg_sq_all = state["exp_avg_sq"].view(num_rows, -1)
        exp_avg = exp_avg_all.index_select(0, index)
        exp_avg_sq = exp_avg_sq_all.index_select(0, index)
        self._moments(group, exp_avg, exp_avg_sq, values)
        beta1, beta2 = group["betas"]
        bias_correction1 = torch.pow(beta1, steps).neg_().add_(1).unsqueeze(-1)
        bias_correction2 = torch.pow(beta2, steps).neg_().add_(1).unsqueeze(-1)
        denom = self._denominator(exp_avg_sq, bias_correction2, group["eps"])
        step_size = self._step_size(group["lr"], bias_correction1, bias_correction2).to(p.dtype)
        exp_avg_all.index_copy_(0, index, exp_avg)
        exp_avg_sq_all.index_copy_(0, index, exp_avg_sq)
        # φ_r − s_r m_r / d_r, written as an addition of its negative (the same numbers: a − b is a + (−b) exactly;
        # the rows are distinct, so each is added to once)
        flat_p.index_add_(0, index, torch.div(exp_avg, denom).mul_(step_size), alpha=-1)


class LazyClippedAdam(LazyAdam):
    r""":class:`LazyAdam` with the update of Pyro's ``ClippedAdam``: every gradient entry clamped to
    ``[-clip_norm, clip_norm]``, the learning rate multiplied by ``lrd`` at every step, and :math:`\epsilon` added to
    :math:`\sqrt{v}` before the bias correction,

    .. math::

        \phi_r \leftarrow \phi_r - \eta\,\frac{\sqrt{1-\beta_2^{t_r}}}{1-\beta_1^{t_r}}\,
        \frac{m_r}{\sqrt{v_r}+\epsilon}.

    With every row touched on every step it gives Pyro's ``ClippedAdam`` to rounding.

    Example::

        optim = pyro_hier.optim.ClippedAdam({"lr": 0.01, "lrd": 0.9999})   # instead of pyro.optim.ClippedAdam
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        clip_norm: float = 10.0,
        lrd: float = 1.0,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, clip_norm=clip_norm, lrd=lrd)

    def _moments(self, group: dict, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor) -> None:
        beta1, beta2 = group["betas"]
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

    def _denominator(self, exp_avg_sq: torch.Tensor, bias_correction2, eps: float):
        return exp_avg_sq.sqrt().add_(eps)

    def _step_size(self, lr: float, bias_correction1, bias_correction2):
        if isinstance(bias_correction2, torch.Tensor):
            return lr * bias_correction2.sqrt() / bias_correction1
        return lr * math.sqrt(bias_correction2) / bias_correction1


def _ravel(indices: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Row numbers (C order over ``shape``) of the multi-indices ``indices`` (``len(shape)`` × n)."""
    flat = indices[0]
    for k in range(1, len(shape)):
        flat = flat * shape[k] + indices[k]
    return flat


class LazyPyroOptim(PyroOptim):
    """Pyro's ``PyroOptim`` (one optimiser per parameter) for :class:`LazyAdam` and :class:`LazyClippedAdam`: a
    parameter without a gradient on this step (a guide's state: references, tail averages, tables that no gradient
    reaches, which ``SVI`` passes with the rest since the step read them) gets its learning rate decayed
    (:meth:`LazyAdam.decay`, what its ``step`` would do) without the call of ``torch.optim.Optimizer.step`` and its
    hooks (about 10 µs each: 10 such parameters a step of the default ``AutoBranchGuide`` under ``JitTrace_ELBO``).
    The same updates as ``PyroOptim``; :func:`Adam` and :func:`ClippedAdam` make it.

    Example::

        optim = LazyPyroOptim(LazyAdam, {"lr": 0.01})      # what pyro_hier.optim.Adam({"lr": 0.01}) returns
    """

    def __call__(self, params, *args, **kwargs) -> None:
        stepped = []
        for p in params:
            optimizer = self.optim_objs.get(p)
            if isinstance(optimizer, LazyAdam) and p.grad is None and self.grad_clip.get(p) is None:
                optimizer.decay()
            else:
                stepped.append(p)
        super().__call__(stepped, *args, **kwargs)


def Adam(optim_args: dict) -> PyroOptim:
    """:class:`LazyAdam` for Pyro's ``SVI`` (a ``pyro.optim.PyroOptim``: :class:`LazyPyroOptim`), a drop-in for
    ``pyro.optim.Adam``: ``pyro_hier.optim.Adam({"lr": 0.01})``. ``optim_args`` is a dict of :class:`LazyAdam`'s
    options, or a callable of the parameter's name returning one (per-parameter options, as in Pyro)."""
    return LazyPyroOptim(LazyAdam, optim_args)


def ClippedAdam(optim_args: dict) -> PyroOptim:
    """:class:`LazyClippedAdam` for Pyro's ``SVI`` (:class:`LazyPyroOptim`), a drop-in for ``pyro.optim.ClippedAdam``:
    ``pyro_hier.optim.ClippedAdam({"lr": 0.01, "clip_norm": 10.0, "lrd": 1.0})``."""
    return LazyPyroOptim(LazyClippedAdam, optim_args)
