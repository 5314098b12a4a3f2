"""Serving demo: a small Llama-architecture decoder (model.py) served by a paged-KV, continuously batched engine
(engine.py) whose prefill and decode attention are tileflash's varlen and kvcache calls, checked token by token
against an fp32 full-recompute reference (check.py). `python -m examples.serving --help` (cli.py) runs it."""
from .cli import main

__all__ = ["main"]
