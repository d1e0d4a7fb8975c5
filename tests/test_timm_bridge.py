"""``create_model('timm/<name>')`` without timm installed: a clear error that names the extra,
raised before anything is built (the main venv has no timm)."""

import importlib.util

import pytest

import structinit


@pytest.mark.skipif(importlib.util.find_spec("timm") is not None, reason="timm is installed here (tests/zoo covers it)")
def test_timm_name_without_timm_names_the_extra():
    with pytest.raises(ImportError,
                       match=r"model='timm/vit_tiny_patch16_224' needs timm.*pip install -e \"\.\[timm\]\" in a clone"):
        structinit.create_model("timm/vit_tiny_patch16_224", num_classes=10)


def test_structinit_names_still_come_from_the_registry():
    with pytest.raises(ValueError, match=r"unknown model 'vit_nonexistent'"):
        structinit.create_model("vit_nonexistent")
