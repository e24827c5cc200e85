"""Small networks shared by the amortized guides: MLPs with the initialisation of Agrawal & Domke (2021, App. A)
and permutation-invariant pooling over the observations of each group, for padded or ragged groups."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from pyro.nn import PyroModule
from torch import nn

__all__ = [
    "MLP",
    "PackedParameters",
    "RateLinear",
    "Standardize",
    "masked_pool",
    "module_key",
    "pool_with_square",
    "readout_multiplier",
    "segment_pool",
    "with_square",
]


def module_key(name: str) -> str:
    """``name`` (a site, plate or level name, which Pyro lets contain ``"."``) as a key of ``nn.ModuleDict`` or a
    submodule's name: dots become underscores (``torch`` refuses them), and a name that is already an attribute of
    modules (``"items"``, ``"keys"``, ``"forward"``, …, which ``nn.ModuleDict`` refuses) gets a trailing underscore.
    Two names can share a key (``"a.b"``, ``"a_b"``); :func:`pyro_hier.guides.base.parameter_keys` keeps them apart.

    Example::

        module_key("items"), module_key("county.effect")  # ("items_", "county_effect")
    """
    key = name.replace(".", "_")
    if hasattr(nn.ModuleDict, key) or hasattr(PyroModule, key):
        key = f"{key}_"
    return key


class RateLinear(nn.Linear):
    r"""``nn.Linear`` whose weight and bias are stored divided by ``rate`` and used multiplied by it:
    :math:`y = r\,(\tilde W x + \tilde b)` with stored :math:`(\tilde W, \tilde b) = (W, b) / r`.

    The function is the same; what changes is how fast Adam moves it. Adam moves every stored number by about the
    learning rate per step whatever its gradient's size, so the effective weights move by ``rate`` times the
    learning rate: an internal per-parameter-group rate multiplier that works with any optimiser the user builds
    (the maximal-update parameterisation's device, Yang & Hu 2021). Used for the conditional flows' networks of
    :class:`~pyro_hier.AutoPlateAmortizedFlow` (:data:`pyro_hier.flows.NETWORK_RATE`).

    Example::

        layer = RateLinear(3, 2, rate=0.1)
        layer(torch.randn(5, 3)).shape  # (5, 2)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, rate: float = 1.0) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be positive, got {rate!r}")
        super().__init__(in_features, out_features, bias=bias)
        self.rate = float(rate)
        with torch.no_grad():
            self.weight.div_(self.rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias) * self.rate  # (one product, on the output)

    def set_weight_(self, value: torch.Tensor) -> None:
        """Set the effective weight (stored divided by the rate)."""
        with torch.no_grad():
            self.weight.copy_(value / self.rate)


class PackedParameters(nn.Module):
    r"""The parameters of some modules held as one flat vector ``flat``, which the modules read through views.

    At construction every parameter of the ``modules`` given is removed from its module and its value copied into
    ``flat`` (in ``named_parameters`` order); :meth:`unpack` then gives each module its parameter as a view of the
    vector passed (``flat`` itself, the param store's tensor, a detached copy, an average), so gradients reach that
    one tensor. Nothing else changes: the modules compute the same functions of the same numbers.

    Why: Pyro's optimisers (``pyro.optim.Adam``, ``ClippedAdam``) keep one torch optimiser per parameter tensor and
    step them one by one, and each ``pyro.param`` statement runs through every handler, so a guide's per-step cost
    grows with its *number* of tensors. Elementwise optimisers (Adam, ``ClippedAdam``'s elementwise clipping, SGD)
    take the same step on the packed vector as on the tensors apart. :class:`~pyro_hier.AutoPlateAmortizedFlow`
    packs its networks, encodings and free affine maps (24 tensors on the three-level model) into one.

    Example::

        net = nn.Linear(3, 2)
        pack = PackedParameters({"net": net})      # net.weight and net.bias are now views of pack.flat
        owners = pack.owners({"net": net})
        pack.unpack(pack.flat, owners)             # (once per call, with the tensor the call optimises)
        net(torch.randn(5, 3)).sum().backward()    # the gradient is pack.flat.grad

    :param modules: ``{name: module}``; the names key the layout (:meth:`owners` takes modules of the same layout
        under the same names, e.g. a copy).
    """

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        super().__init__()
        layout: list[tuple[str, str, str, torch.Size]] = []
        values = []
        for root_name, root in modules.items():
            for name, param in root.named_parameters():
                path, _, key = name.rpartition(".")
                layout.append((root_name, path, key, param.shape))
                values.append(param.detach().reshape(-1))
        if not values:
            raise ValueError("PackedParameters: the modules given have no parameters")
        self.layout = layout
        self.sizes = [shape.numel() for *_, shape in layout]
        self.flat = nn.Parameter(torch.cat(values))
        for (owner, key), piece, shape in zip(self.owners(modules), self.flat.detach().split(self.sizes), self.shapes):
            del owner._parameters[key]
            owner.__dict__[key] = piece.view(shape)

    @property
    def shapes(self) -> list[torch.Size]:
        return [shape for *_, shape in self.layout]

    def owners(self, modules: dict[str, nn.Module]) -> list[tuple[nn.Module, str] | None]:
        """``(module, attribute)`` of each packed parameter in ``modules`` (a layout's root missing from them:
        ``None``, skipped by :meth:`unpack`); found once, passed to every :meth:`unpack`."""
        return [
            None if root_name not in modules else (modules[root_name].get_submodule(path), key)
            for root_name, path, key, _ in self.layout
        ]

    def unpack(self, flat: torch.Tensor, owners: list[tuple[nn.Module, str] | None]) -> None:
        """Give each module its parameters as views of ``flat`` (one ``split``: one node in the backward pass)."""
        for owner, piece, shape in zip(owners, flat.split(self.sizes), self.shapes, strict=True):
            if owner is not None:
                owner[0].__dict__[owner[1]] = piece.view(shape)


class MLP(nn.Sequential):
    """Leaky-ReLU multilayer perceptron ``in → hidden[0] → … → hidden[-1] → out``.

    Weights start from a normal truncated at two standard deviations with std ``sqrt(1 / fan_in)``, biases at zero;
    the last layer's weights use std ``last_layer_std`` (the paper's 0.001 makes the outputs start near zero, so an
    amortized ``q(z_i | θ)`` starts near its initial value whatever the data). With ``rate`` other than 1 the layers
    are :class:`RateLinear` (Adam moves the network ``rate`` times as fast; same function at initialisation).

    Example::

        net = MLP(3, [64, 64], 10, last_layer_std=1e-3)
        net(torch.randn(5, 3)).shape  # (5, 10)
    """

    def __init__(
        self,
        in_features: int,
        hidden: Sequence[int],
        out_features: int,
        *,
        negative_slope: float = 0.01,
        last_layer_std: float | None = None,
        rate: float = 1.0,
    ) -> None:
        if in_features < 1 or out_features < 1 or any(h < 1 for h in hidden):
            raise ValueError(f"layer sizes must be positive, got {in_features}, {list(hidden)}, {out_features}")
        sizes = [in_features, *hidden, out_features]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            linear = nn.Linear(a, b) if rate == 1.0 else RateLinear(a, b, rate=rate)
            last = i == len(sizes) - 2
            std = last_layer_std if (last and last_layer_std is not None) else math.sqrt(1.0 / a)
            with torch.no_grad():
                nn.init.trunc_normal_(linear.weight, std=std, a=-2 * std, b=2 * std)
                linear.weight.div_(rate)  # (stored divided by the rate: the same function)
                linear.bias.zero_()
            layers.append(linear)
            if not last:
                layers.append(nn.LeakyReLU(negative_slope))
        super().__init__(*layers)
        self.in_features, self.out_features = in_features, out_features


def readout_multiplier(hidden: Sequence[int], in_features: int) -> float:
    r"""``1 / H`` with ``H`` the width feeding an MLP's last layer (``hidden[-1]``, or ``in_features`` without hidden
    layers): the output multiplier of the maximal-update parameterisation for Adam (Yang & Hu 2021, *Feature
    Learning in Infinite-Width Neural Networks*).

    An Adam step moves every weight by about the learning rate whatever its gradient, so an output summing ``H``
    units moves about ``H`` times as far per step as a free parameter; multiplying the output by ``1 / H`` restores
    a free parameter's step. Used by the flows' conditioners and the deep-set readout.

    Example::

        net = MLP(5, [32], 4)
        out = readout_multiplier([32], 5) * net(x)   # moves about lr per Adam step
    """
    return 1.0 / (hidden[-1] if len(hidden) else in_features)


def segment_pool(values: torch.Tensor, segments: torch.Tensor, num_segments: int, how: str = "mean") -> torch.Tensor:
    """Pool rows of ``values`` (M, F) into ``num_segments`` rows by ``segments`` (M,) — ragged groups, no padding.

    ``how`` is ``"mean"``, ``"sum"`` or ``"max"``. An empty segment pools to zeros.
    """
    if values.dim() != 2 or segments.dim() != 1 or segments.shape[0] != values.shape[0]:
        raise ValueError(
            f"expected values (M, F) and segments (M,), got {tuple(values.shape)}, {tuple(segments.shape)}"
        )
    out = values.new_zeros(num_segments, values.shape[1])
    index = segments.unsqueeze(-1).expand_as(values)
    if how == "max":
        out = out.fill_(-math.inf).scatter_reduce(0, index, values, reduce="amax", include_self=True)
        return torch.where(torch.isinf(out), torch.zeros_like(out), out)
    out = out.index_add(0, segments, values)
    if how == "sum":
        return out
    if how == "mean":
        counts = torch.bincount(segments, minlength=num_segments).clamp(min=1).to(values.dtype)
        return out / counts.unsqueeze(-1)
    raise ValueError(f"how must be 'mean', 'sum' or 'max', got {how!r}")


def with_square(features: torch.Tensor) -> torch.Tensor:
    """``[e, e²]`` along the last dim: the paper's embedding and its elementwise square, pooled together."""
    return torch.cat([features, features * features], dim=-1)


def pool_with_square(features: torch.Tensor, dim: int = -2, how: str = "mean") -> torch.Tensor:
    """Pool ``[e, e²]`` over ``dim`` (padded groups): the paper's concatenation of the embedding and its
    elementwise square before pooling."""
    both = with_square(features)
    if how == "mean":
        return both.mean(dim)
    if how == "sum":
        return both.sum(dim)
    if how == "max":
        return both.amax(dim)
    raise ValueError(f"how must be 'mean', 'sum' or 'max', got {how!r}")


class Standardize(nn.Module):
    """``x ↦ (x − mean) / scale`` with fixed statistics (buffers, so they move with ``.to()`` and enter the
    ``state_dict``), computed once from the training data so that networks see inputs of order one.

    Example::

        norm = Standardize.from_data(features)           # features (M, F)
        norm(features).mean(0)                           # ≈ 0
    """

    def __init__(self, mean: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        if mean.shape != scale.shape or mean.dim() != 1:
            raise ValueError(f"mean and scale must be vectors of one shape, got {mean.shape} and {scale.shape}")
        self.register_buffer("mean", mean.clone())
        self.register_buffer("scale", scale.clone())

    @classmethod
    def from_data(cls, features: torch.Tensor, weights: torch.Tensor | None = None) -> Standardize:
        """Statistics of the rows of ``features`` (..., F), optionally weighted (e.g. by an observation mask); a
        feature that does not vary gets scale 1."""
        x = features.reshape(-1, features.shape[-1])
        w = torch.ones(x.shape[0], dtype=x.dtype, device=x.device) if weights is None else weights.reshape(-1)
        w = w.to(x.dtype) / w.sum().clamp(min=1)
        mean = (w.unsqueeze(-1) * x).sum(0)
        sd = (w.unsqueeze(-1) * (x - mean) ** 2).sum(0).sqrt()
        return cls(mean, torch.where(sd > 1e-8 * (1 + mean.abs()), sd, torch.ones_like(sd)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.scale


def masked_pool(features: torch.Tensor, mask: torch.Tensor | None, dim: int = -2, how: str = "mean") -> torch.Tensor:
    """Pool ``[e, e²]`` over ``dim`` counting only the entries where ``mask`` (broadcastable to ``features`` without
    its last dim) is true: padded groups give the same result as their ragged rows (:func:`segment_pool`)."""
    if mask is None:
        return pool_with_square(features, dim, how)
    both = with_square(features)
    m = mask.unsqueeze(-1).to(both.dtype)
    if how == "max":
        filled = both.masked_fill(m == 0, -math.inf).amax(dim)
        return torch.where(torch.isinf(filled), torch.zeros_like(filled), filled)
    total = (both * m).sum(dim)
    if how == "sum":
        return total
    if how == "mean":
        return total / m.sum(dim).clamp(min=1)
    raise ValueError(f"how must be 'mean', 'sum' or 'max', got {how!r}")
