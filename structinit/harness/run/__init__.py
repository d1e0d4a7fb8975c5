"""One run's lifecycle: the training loop, its checkpoints and files, its folder and lock, its
device and precision, and the optimiser every run shares."""
