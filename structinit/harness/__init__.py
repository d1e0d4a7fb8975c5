"""The training harness: the training loop, run files (checkpoints, metrics, exported
weights), recipes, init specs, comparisons, the demo and the command line. Needs the
``harness`` extra (scikit-learn, matplotlib, pillow, tqdm, safetensors)."""
