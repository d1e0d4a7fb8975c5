"""The inits on models structinit did not build: a Hugging Face ``transformers`` ViT from a
config (image 32, patch 4, hidden 192, 3 heads, 4 layers, class token)
next to the structinit ViT of the same size, in one run.

For each row: the layout structinit found (grid, prefix tokens, where the PE lives), the init
time (median of ``--repeats``), and impulse fidelity (attention mass on the target and argmax
hit rate, layer 1 and mean over layers) on the first ``--images`` CIFAR-10 test images.
``impulse, HF learned PE kept`` is what a user got before position discovery: the hints
``grid=(8, 8)``, ``pos_embed=`` HF's learned table, ``pe_scale=None``, no reservation.

    .venv/bin/python bench/own_models.py --data-dir ../shared/datasets
"""

from __future__ import annotations

import argparse

import torch
from common import DATA_DIR, cifar_test_images, fidelity_row, timed_init

import structinit as si

CONFIG = dict(image_size=32, patch_size=4, hidden_size=192, num_attention_heads=3, num_hidden_layers=4,
              intermediate_size=768, num_labels=10)


def hf_vit(seed: int):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    return ViTForImageClassification(ViTConfig(**CONFIG))


def structinit_vit(seed: int):
    torch.manual_seed(seed)
    return si.models.VisionTransformer(img_size=32, patch_size=4, num_classes=10, embed_dim=192, depth=4,
                                       num_heads=3, mlp_ratio=4.0, class_token=True, global_pool="token")


def hinted_options(model) -> dict:
    """The four hints a user needed before discovery, on HF's own learned table."""
    pe = model.vit.embeddings.position_embeddings.detach()[0, 1:]
    return dict(grid=(8, 8), num_prefix_tokens=1, pos_embed=pe, pe_scale=None, reserve="none")


ROWS = [  # (label, model builder, scheme, the options: a function of the model)
    ("HF ViT: impulse, HF learned PE kept (old hints)", hf_vit, "impulse", hinted_options),
    ("HF ViT: impulse, no hints (defaults)", hf_vit, "impulse", lambda model: {}),
    ("structinit ViT same size: impulse defaults", structinit_vit, "impulse", lambda model: {}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=DATA_DIR)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    images = cifar_test_images(args.data_dir, args.images)
    print(f"{args.images} CIFAR-10 test images, seed {args.seed}, init time = median of {args.repeats}\n")
    print("| model and init | layout found | init s | mass L1 | hit L1 | mass mean | hit mean |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, build, scheme, options in ROWS:
        model, seconds = timed_init(lambda: build(args.seed), scheme, args.seed, args.repeats, options)
        layout = si.infer_layout(model)
        where = si.find_position_embedding(model).pos_embed_name
        row = fidelity_row(si.impulse_fidelity(model, images))
        print(f"| {label} | {layout.grid[0]}×{layout.grid[1]} + {layout.num_prefix_tokens} prefix, `{where}` | "
              f"{seconds:.3f} | " + " | ".join(f"{v:.3f}" for v in row) + " |")


if __name__ == "__main__":
    main()
