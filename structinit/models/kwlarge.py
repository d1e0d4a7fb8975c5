"""KWLarge (Wong et al. 2018; the default model of Trockman & Kolter, ICLR 2021), built from
Cayley orthogonal layers so that the whole network is 1-Lipschitz in ℓ₂::

    conv c→c1 (3×3) · GroupSort · conv c1→c1 (4×4, stride 2) · GroupSort
    conv c1→c2 (3×3) · GroupSort · conv c2→c2 (4×4, stride 2) · GroupSort
    flatten · FC c2·(s/4)²→h · GroupSort · FC h→h · GroupSort · FC h→num_classes

The published KWLarge has (c1, c2, h) = (32, 64, 512)·w for 32×32 inputs (flatten 4096·w).
A stride-2 conv is space-to-depth then a 2×2 Cayley conv (:class:`CayleyConv2d`).
``conv='plain'`` builds the same network from ``nn.Conv2d`` (circular padding) and
``nn.Linear``, the unconstrained baseline (not 1-Lipschitz).
"""

from __future__ import annotations

from torch import nn

from structinit.models.layers_orthogonal import CayleyConv2d, CayleyLinear, GroupSort
from structinit.models.registry import register_model
from structinit.utils.checks import check_sizes


def _plain_conv(c_in: int, c_out: int, k: int, n: int, stride: int) -> nn.Conv2d:
    # circular 'same' padding as the Cayley conv (an even k pads one more on the right/bottom)
    conv = nn.Conv2d(c_in, c_out, k, stride=stride, padding=0)
    pads = ((k - 1) // 2, k // 2, (k - 1) // 2, k // 2)
    return nn.Sequential(nn.CircularPad2d(pads), conv) if k > 1 else conv


class KWLarge(nn.Sequential):
    """KWLarge with channels ``(c1, c2)`` and hidden width ``hidden``: input
    (B, in_chans, img_size, img_size) → logits (B, num_classes). ``conv``: 'cayley'
    (1-Lipschitz) or 'plain'. ``img_size`` must be a multiple of 4; c1, c2 and hidden even
    (GroupSort pairs channel halves)."""

    def __init__(self, channels: tuple[int, int] = (32, 64), hidden: int = 512, num_classes: int = 10,
                 in_chans: int = 3, img_size: int = 32, conv: str = "cayley"):
        check_sizes(hidden=hidden, num_classes=num_classes, in_chans=in_chans, img_size=img_size,
                    **dict(zip(("channels[0]", "channels[1]"), channels)))
        if len(channels) != 2 or any(c % 2 for c in (*channels, hidden)):
            raise ValueError(f"channels={channels!r}, hidden={hidden!r}: expected two even channel counts and an "
                             "even hidden width (GroupSort pairs halves)")
        if img_size % 4:
            raise ValueError(f"img_size={img_size}: expected a multiple of 4 (two stride-2 convs)")
        if conv not in ("cayley", "plain"):
            raise ValueError(f"conv={conv!r}: valid names are cayley, plain")
        c1, c2 = channels
        s = img_size
        make_conv, linear = (CayleyConv2d, CayleyLinear) if conv == "cayley" else (_plain_conv, nn.Linear)
        super().__init__(
            make_conv(in_chans, c1, 3, s, 1), GroupSort(),
            make_conv(c1, c1, 4, s, 2), GroupSort(),
            make_conv(c1, c2, 3, s // 2, 1), GroupSort(),
            make_conv(c2, c2, 4, s // 2, 2), GroupSort(),
            nn.Flatten(),
            linear(c2 * (s // 4) ** 2, hidden), GroupSort(),
            linear(hidden, hidden), GroupSort(),
            linear(hidden, num_classes),
        )
        self.num_classes, self.img_size, self.conv = num_classes, img_size, conv
        # The ℓ₂ Lipschitz bound the harness certifies with (structinit.analysis.certify.model_lipschitz):
        # every layer of the Cayley network is 1-Lipschitz; the plain one has no bound.
        self.lipschitz_bound = 1.0 if conv == "cayley" else None


@register_model
def kwlarge(**kwargs) -> KWLarge:
    """The published KWLarge (w = 1): channels (32, 64), hidden 512, 32×32 inputs."""
    return KWLarge(**{"channels": (32, 64), "hidden": 512, **kwargs})


@register_model
def kwlarge_cpu(**kwargs) -> KWLarge:
    """KWLarge at a CPU width: channels (16, 32), hidden 256 (≈ 0.6 M parameters at 32×32).

    Examples:
        >>> model = structinit.create_model("kwlarge_cpu", num_classes=10)
    """
    return KWLarge(**{"channels": (16, 32), "hidden": 256, **kwargs})
