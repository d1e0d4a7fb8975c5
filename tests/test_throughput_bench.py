"""bench/throughput.py times the step ``structinit train`` takes, not a copy of it: the same
batches through the same step make the same weights as a run of the loop."""

import throughput
import torch
from safetensors.torch import load_file

from structinit.harness.recipes import recipe
from structinit.harness.tasks import train
from structinit.harness.tasks.image import load_data


def test_the_benchmarks_step_is_the_loops_step(tmp_path):
    cfg = recipe("digits", epochs=2, train_size=128, out_dir=str(tmp_path / "run"))
    train(cfg, progress=False)
    trained = load_file(tmp_path / "run" / "model.safetensors")
    data, _ = load_data(cfg)
    rates, model = throughput.step_rates(cfg, data, epochs=2, keep_model=True)
    assert len(rates) == 2 and all(r > 0 for r in rates)
    mine = model.state_dict()
    assert trained.keys() == mine.keys()
    for name, value in trained.items():
        torch.testing.assert_close(mine[name], value, rtol=0, atol=0, msg=name)
