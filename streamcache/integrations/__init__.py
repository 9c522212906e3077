"""streamcache in the tools users train with; each module imports its tool, nothing here does.

- :mod:`.transformers`: ``StreamTrainer`` / ``StreamTrainerMixin``, a Hugging Face Trainer
  over a StreamLoader, resumed exactly from its checkpoints.
- :mod:`.accelerate`: how a StreamLoader meets ``accelerator.prepare``, the refusal of a
  StreamDataset wrapped in a DataLoader that Accelerate shards or dispatches, and of an
  Accelerator that counts other processes than the job (``cpu=True`` forgotten on CPUs).
- :mod:`.lightning`: ``StreamStats``, a Lightning callback that logs the loader's input
  statistics.
"""
