"""Torch-facing layer: input checks, launchers, torch.library custom ops with fake implementations."""
