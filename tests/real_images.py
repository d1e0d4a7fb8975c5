"""Real images without a download, for tests that read a model's own attention on real data."""

import torch
from torch import nn


def digit_images(n: int = 8, size: int = 32) -> torch.Tensor:
    """(n, 3, size, size): sklearn's 8×8 handwritten digits, upsampled, three channels, standardised."""
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().images[:n], dtype=torch.float32)[:, None].repeat(1, 3, 1, 1) / 16
    x = nn.functional.interpolate(x, size=size, mode="bilinear", align_corners=False)
    return (x - x.mean()) / x.std()
