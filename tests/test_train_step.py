"""The training step every run takes (structinit.harness.run.step.TrainStep) and the batches
it is fed: on CUDA neither waits for the device (no host-device synchronisation), and the
optimiser is fused there; on the CPU the step is the loop's, bit for bit."""

import dataclasses

import pytest
import torch

from structinit.data.datasets import ArrayDataset
from structinit.harness.recipes import recipe
from structinit.harness.run.device import Placement
from structinit.harness.tasks.image import ImageTask, image_step

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _step(device: torch.device, augment: str, images: int = 96, batch: int = 32, **overrides):
    """(task, step, placement) of a paper-cifar-like run of a micro ViT on random uint8 images."""
    cfg = recipe("paper-cifar", model="vit_micro_patch2_16", batch_size=batch, augment=augment, epochs=2,
                 warmup_epochs=1, data_dir=None, test_prefix=None, test_every=1, **overrides)
    g = torch.Generator().manual_seed(0)
    data = ArrayDataset(torch.randint(0, 256, (images, 3, 16, 16), dtype=torch.uint8, generator=g),
                        torch.randint(0, 10, (images,), generator=g), [str(k) for k in range(10)], "random",
                        (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    task, step = image_step(cfg, data, device)
    return task, step, Placement(1, 0, device)


def test_the_step_follows_the_schedule_and_changes_the_weights():
    task, step, where = _step(torch.device("cpu"), "flip")
    chunks, total, warmup = task.schedule()
    assert (total, warmup) == (6, 3) and step.lr(0) == pytest.approx(task.cfg.warmup_lr)
    before = {k: v.clone() for k, v in step.model.state_dict().items()}
    x, y = next(task.batches(chunks[0], where))
    loss, logits = step(0, x, y)
    assert not loss.requires_grad and not logits.requires_grad and logits.shape == (32, 10)
    assert step.opt.param_groups[0]["lr"] == step.lr(0)
    assert any(not torch.equal(before[k], v) for k, v in step.model.state_dict().items())
    assert "fused" not in step.opt.defaults or not step.opt.defaults["fused"]  # the CPU keeps torch's default


@needs_cuda
@pytest.mark.parametrize(("cpu_prefetch", "aug_workers"), [(0, 0), (2, 0), (0, 2)])
def test_cuda_step_and_batches_never_wait_for_the_device(cpu_prefetch, aug_workers):
    # paper-cifar's augmentation (RandAugment draws per image on the CPU, every op; on the
    # device, or on the CPU ahead of the step) and the step, after one warm-up step: any
    # host-device synchronisation raises.
    task, step, where = _step(torch.device("cuda"), "flip,ra2-9-0.5", images=512, batch=64,
                              cpu_prefetch=cpu_prefetch, aug_workers=aug_workers)
    assert step.opt.defaults.get("fused") is True
    batches = task.batches(task.schedule()[0][0], where)
    step(0, *next(batches))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, (x, y) in enumerate(batches, start=1):
            step(i, x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        task.close()
    torch.cuda.synchronize()


def test_batches_augmented_ahead_on_the_cpu_are_the_same_batches():
    # cpu_prefetch moves the augmentation to a background thread on the CPU: the same images,
    # labels and order as augmenting inside the loop (on a GPU, blends may round a tie the other way)
    task, _, where = _step(torch.device("cpu"), "flip,ra2-9-0.5,crop4")
    chunk = task.schedule()[0][1]
    inline = list(task.batches(chunk, where))
    task.cfg = dataclasses.replace(task.cfg, cpu_prefetch=2)
    ahead = list(task.batches(chunk, where))
    assert len(ahead) == len(inline) == task.steps
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ahead, inline))


def test_a_run_resumes_with_another_cpu_prefetch_but_not_another_augmentation(tmp_path):
    from structinit.harness.run.lifecycle import run_task

    cfg = recipe("digits", epochs=1, out_dir=str(tmp_path / "run"))
    done = run_task(ImageTask(cfg), progress=False)
    with pytest.raises(ValueError, match="augment"):
        run_task(ImageTask(dataclasses.replace(cfg, augment="flip")), resume=True, progress=False)
    # how the batches are made is not what they are: the finished run is found, not refused
    again = run_task(ImageTask(dataclasses.replace(cfg, cpu_prefetch=3)), resume=True, progress=False)
    assert again["history"] == done["history"] and again["init_fingerprint"] == done["init_fingerprint"]


def _epochs(task, where, epochs=2):
    return [list(task.batches(chunk, where)) for chunk in task.schedule()[0][:epochs]]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(len(ea) == len(eb) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
                                                               for x, y in zip(ea, eb)) for ea, eb in zip(a, b))


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_the_batches_of_a_seed_are_the_same_for_any_worker_count():
    # Two epochs (the workers outlive the first), paper-cifar's augmentation and a crop: in the step,
    # in a thread, and in 1, 2 or 3 worker processes, the same images, labels and order.
    task, _, where = _step(torch.device("cpu"), "flip,ra2-9-0.5,crop4", images=100, batch=16)
    inline = _epochs(task, where)
    assert len(inline) == 2 and len(inline[0]) == task.steps == 6
    assert not torch.equal(inline[0][0][0], inline[1][0][0])
    for kind in ({"cpu_prefetch": 2}, {"aug_workers": 1}, {"aug_workers": 2}, {"aug_workers": 3}):
        task.cfg = dataclasses.replace(task.cfg, **{"cpu_prefetch": 0, "aug_workers": 0, **kind})
        try:
            assert _same(_epochs(task, where), inline), kind
        finally:
            task.close()
    task.cfg = dataclasses.replace(task.cfg, aug_workers=0, seed=1)  # and another seed gives other batches
    assert not _same(_epochs(task, where), inline)


def test_a_batch_depends_on_its_key_alone():
    # Any order of making the batches gives the same batches: what lets workers make them in any order.
    from structinit.harness.tasks.image_batches import EpochBatches

    task, _, _ = _step(torch.device("cpu"), "flip,ra2-9-0.5", images=64, batch=16)
    source = EpochBatches(task.cpu_images, task.augment, seed=0, rank=0, world=1, per_rank=16, steps=4)
    forward = [source[k] for k in range(8)]
    again = EpochBatches(task.cpu_images, task.augment, seed=0, rank=0, world=1, per_rank=16, steps=4)
    backward = [again[k] for k in reversed(range(8))][::-1]
    assert all(torch.equal(a, b) for a, b in zip(forward, backward))
    assert sorted(torch.cat([source.order(0), source.order(1)]).tolist()) == sorted(list(range(64)) * 2)


def test_an_error_in_a_worker_reaches_the_run():
    from structinit.harness.tasks.image_batches import AugmentWorkers, EpochBatches

    def broken(x, generator):
        raise ValueError("this augmentation is broken")

    source = EpochBatches(torch.zeros(8, 3, 4, 4, dtype=torch.uint8), broken, seed=0, rank=0, world=1, per_rank=4,
                          steps=2)
    pool = AugmentWorkers(source, workers=1)
    try:
        with pytest.raises(ValueError, match="this augmentation is broken"):
            list(pool.epoch(0))
    finally:
        pool.close()
    with pytest.raises(ValueError, match="workers=0"):
        AugmentWorkers(source, workers=0)


def test_a_run_trains_the_same_with_augmentation_workers(tmp_path):
    # The whole run, bit for bit: the weights and the history (times aside) with and without workers.
    from safetensors.torch import load_file

    from structinit.harness.tasks import train

    runs = {}
    for workers in (0, 2):
        cfg = recipe("digits", epochs=2, augment="flip,crop1", aug_workers=workers,
                     out_dir=str(tmp_path / f"w{workers}"))
        result = train(cfg, progress=False)
        runs[workers] = ([{k: v for k, v in row.items() if k not in ("wall_s", "images_per_s")}
                          for row in result["history"]], load_file(tmp_path / f"w{workers}" / "model.safetensors"))
    assert runs[0][0] == runs[2][0]
    assert all(torch.equal(runs[0][1][k], runs[2][1][k]) for k in runs[0][1])
