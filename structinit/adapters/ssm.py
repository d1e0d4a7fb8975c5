"""Finding selective state-space (Mamba-1) layers and viewing their parameters in one layout.

An :class:`SSMAdapter` exposes, for one SSM module, tensors *aliasing the module's storage*:

* ``A_log`` (d_inner, N), with A = −exp(A_log);
* ``dt_weight`` (d_inner, dt_rank) and ``dt_bias`` (d_inner), with Δ = softplus(dt_weight δ + dt_bias);
* ``w_b`` and ``w_c`` (N, d_inner): the rows of the input projection that give B_t = W_B x_t and
  C_t = W_C x_t;
* ``conv_weight`` (d_inner, 1, d_conv) and ``conv_bias`` (d_inner) or None: the causal depthwise
  conv, whose last tap (index d_conv − 1) multiplies the current token;
* ``D`` (d_inner): the skip.

The built-in adapters cover ``mambapy.mamba.MambaBlock`` (pure-PyTorch Mamba-1) and Hugging Face
``transformers``' ``MambaMixer``. They are matched by class name and module, so structinit imports
without either package. Teach structinit another SSM class with :func:`register_ssm_adapter`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from structinit.adapters.registry import AdapterEntry, _target_name, first_match, target_matcher
from structinit.utils import Registry


class SSMAdapter:
    """View of one Mamba-1-style SSM module (see the module docstring for the layout).

    Subclasses set ``module`` and implement the tensor properties; ``d_inner``, ``d_state``,
    ``dt_rank`` and ``d_conv`` are read from the tensors' shapes.
    """

    module: nn.Module

    # -- tensors (views of the module's parameters) -----------------------------------------
    @property
    def A_log(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def dt_weight(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def dt_bias(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def w_b(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def w_c(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def conv_weight(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def conv_bias(self) -> torch.Tensor | None:
        raise NotImplementedError

    @property
    def D(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def normalises_bc(self) -> bool:
        """Whether B and C are normalised after their projection (then W_Cᵀ W_B is not the
        product the scan uses); False unless an adapter says otherwise."""
        return False

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def d_inner(self) -> int:
        return self.A_log.shape[0]

    @property
    def d_state(self) -> int:
        return self.A_log.shape[1]

    @property
    def dt_rank(self) -> int:
        return self.dt_weight.shape[1]

    @property
    def d_conv(self) -> int:
        return self.conv_weight.shape[-1]

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({type(self.module).__name__}, d_inner={self.d_inner}, "
                f"d_state={self.d_state}, dt_rank={self.dt_rank}, d_conv={self.d_conv})")


class MambapyAdapter(SSMAdapter):
    """``mambapy.mamba.MambaBlock``: rows [dt_rank, dt_rank + N) of ``x_proj.weight`` are W_B,
    rows [dt_rank + N, dt_rank + 2N) are W_C; ``conv1d`` is left-padded by d_conv − 1 and cut to
    the first L outputs, so its last tap is the current token.

    Examples:
        >>> from mambapy.mamba import Mamba, MambaConfig
        >>> block = Mamba(MambaConfig(d_model=8, n_layers=1)).layers[0].mixer
        >>> MambapyAdapter(block).w_b.shape
        torch.Size([16, 16])
    """

    CLASS, PACKAGE = "MambaBlock", "mambapy"  # matched by name: the package is never imported here

    @classmethod
    def matches(cls, module: object) -> bool:
        kind = type(module)
        return (isinstance(module, nn.Module) and kind.__name__ == cls.CLASS
                and kind.__module__.partition(".")[0] == cls.PACKAGE)

    def __init__(self, module: nn.Module):
        if not self.matches(module):
            raise TypeError(f"{type(self).__name__} needs a {self.PACKAGE} {self.CLASS}, got {type(module).__name__}")
        self.module = module
        rows = self.dt_rank + 2 * self.d_state
        if module.x_proj.weight.shape != (rows, self.d_inner):
            raise ValueError(f"{type(module).__name__}.x_proj.weight has shape {tuple(module.x_proj.weight.shape)}, "
                             f"expected (dt_rank + 2·d_state, d_inner) = ({rows}, {self.d_inner})")

    A_log = property(lambda self: self.module.A_log)
    dt_weight = property(lambda self: self.module.dt_proj.weight)
    dt_bias = property(lambda self: self.module.dt_proj.bias)
    w_b = property(lambda self: self.module.x_proj.weight[self.dt_rank:self.dt_rank + self.d_state])
    w_c = property(lambda self: self.module.x_proj.weight[self.dt_rank + self.d_state:self.dt_rank + 2 * self.d_state])
    conv_weight = property(lambda self: self.module.conv1d.weight)
    conv_bias = property(lambda self: self.module.conv1d.bias)
    D = property(lambda self: self.module.D)
    normalises_bc = property(lambda self: getattr(self.module, "B_layernorm", None) is not None)


class HuggingFaceMambaAdapter(MambapyAdapter):
    """Hugging Face ``transformers``' ``MambaMixer`` (``MambaModel``, ``MambaForCausalLM``):
    the same parameter names and ``x_proj`` layout (dt, B, C rows) as mambapy, and the same
    left-padded ``conv1d`` whose last tap is the current token."""

    CLASS, PACKAGE = "MambaMixer", "transformers"


SSM_ADAPTERS: Registry[AdapterEntry] = Registry("SSM adapter")
for _cls in (MambapyAdapter, HuggingFaceMambaAdapter):
    SSM_ADAPTERS.register(f"structinit.{_cls.__name__}", AdapterEntry(_cls.matches, _cls))


def register_ssm_adapter(target: type[nn.Module] | Callable[[nn.Module], bool],
                         factory: Callable[[nn.Module], SSMAdapter]) -> None:
    """Teach structinit a new SSM class: ``target`` is a module class (``isinstance``) or a
    predicate; ``factory(module)`` returns an :class:`SSMAdapter`. User adapters are tried
    first, most recent first; registering a target again replaces its factory."""
    match = target_matcher(target, factory, "SSMAdapter")
    SSM_ADAPTERS.register(_target_name(target), AdapterEntry(match, factory), replace=True, first=True)


def unregister_ssm_adapter(target: type[nn.Module] | Callable[[nn.Module], bool]) -> None:
    """Forget an adapter added by :func:`register_ssm_adapter`."""
    SSM_ADAPTERS.remove(_target_name(target))


def ssm_adapter_for(module: object) -> SSMAdapter | None:
    """The adapter of the first registry entry that matches ``module``, or None."""
    return first_match(SSM_ADAPTERS, module)


def is_ssm(module: object) -> bool:
    """True for a module some SSM adapter understands (e.g. a ``mambapy.mamba.MambaBlock``)."""
    return any(entry.match(module) for entry in SSM_ADAPTERS.values())


def find_ssm_layers(model: nn.Module) -> list[tuple[str, SSMAdapter]]:
    """The SSM layers of ``model`` as (qualified name, adapter), in module order.

    Raises ``ValueError`` if there is none.

    Examples:
        >>> from mambapy.mamba import Mamba, MambaConfig
        >>> [n for n, _ in find_ssm_layers(Mamba(MambaConfig(d_model=8, n_layers=2)))]
        ['layers.0.mixer', 'layers.1.mixer']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    found = [(n, ad) for n, m in model.named_modules() if (ad := ssm_adapter_for(m)) is not None]
    if not found:
        raise ValueError(f"{type(model).__name__} has no SSM layer (looked for a mambapy MambaBlock, a transformers "
                         "MambaMixer or a class registered with register_ssm_adapter; adapters: "
                         f"{', '.join(SSM_ADAPTERS.names())}); the "
                         "SSM schemes initialise Mamba-style selective state-space layers; for other models use an "
                         "attention, conv or model-wide scheme")
    return found
