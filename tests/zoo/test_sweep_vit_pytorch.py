"""The registry sweep's vit-pytorch entries (``bench/sweep_models.py``) on the package itself:
found by walking it, built small, wrappers and models of sequences, volumes or video left out."""

import sweep
import torch


def test_vit_pytorch_entries_find_its_image_models_and_build_them_small():
    """Found by walking the package: plain, hierarchical (per-stage depths), **kwargs (CCT) and
    *args (DistillableViT) constructors alike, each built small; wrappers, trainers and 1-D, 3-D
    and video models left out."""
    entries = dict(sweep.vit_pytorch_entries())
    built = ("vit.ViT", "simple_vit.SimpleViT", "cait.CaiT", "max_vit.MaxViT", "cct.CCT", "distill.DistillableViT")
    assert set(built) <= set(entries)
    assert not {"mae.MAE", "simmim.SimMIM", "dino.Dino", "extractor.Extractor", "recorder.Recorder",
                "distill.DistillWrapper", "learnable_memory_vit.Adapter", "efficient.ViT", "vit_1d.ViT",
                "simple_vit_3d.SimpleViT", "vivit.ViViT", "cct.TransformerClassifier"} & set(entries)
    for name in built:
        model = entries[name]()
        assert sum(p.numel() for p in model.parameters()) < 2_000_000, name
        assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10), name
