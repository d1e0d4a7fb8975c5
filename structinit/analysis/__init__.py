"""Looking inside an initialised or trained model: attention maps through one capture path,
and impulse fidelity."""

from structinit.analysis.capture import attention_maps, check_all_called, layer_input, run_with_hooks
from structinit.analysis.fidelity import FidelitySummary, fidelity_summary, impulse_fidelity

__all__ = ["FidelitySummary", "attention_maps", "check_all_called", "fidelity_summary", "impulse_fidelity",
           "layer_input", "run_with_hooks"]
