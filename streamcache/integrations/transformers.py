"""Hugging Face ``Trainer`` with a :class:`~streamcache.StreamLoader`, resumed exactly.

    from streamcache.integrations.transformers import StreamTrainer

    loader = StreamLoader(StreamDataset(url, global_batch_size=256, seed=0))
    trainer = StreamTrainer(model=model, args=TrainingArguments(...), train_loader=loader,
                            model_inputs=["input_ids", "attention_mask", "labels"])
    trainer.train(resume_from_checkpoint=True)   # after a crash: the next global batch

What the Trainer would do with ``train_dataset=StreamDataset(...)`` is wrong twice over: it
batches the dataset's batches again, and Accelerate shards or dispatches them although each
rank already reads its own part (the dataset refuses that, see
:mod:`streamcache.integrations.accelerate`). :class:`StreamTrainerMixin` gives the Trainer the
loader instead:

- ``get_train_dataloader`` returns it (Accelerate leaves a loader that is not a
  ``torch.utils.data.DataLoader`` as it is: no second sharding, no dispatch); ``len`` is the
  epoch's steps, so the Trainer's epochs and ``max_steps`` are the loader's; the Trainer's
  count of samples (``train_samples_per_second``, "Total train batch size") takes the
  loader's global batch, not ``per_device_train_batch_size``;
- every checkpoint of the Trainer (``checkpoint-N/``) gets ``streamcache_loader.json``, the
  loader's state, written atomically by the main process before the Trainer writes
  ``trainer_state.json`` (a checkpoint the Trainer resumes from has it);
- ``train(resume_from_checkpoint=...)`` loads it (strictly: another dataset or seed is a
  :class:`~streamcache.CursorMismatchError`) and checks that it is where the Trainer's own
  count puts the job (epoch and batch from ``global_step``); the Trainer then skips the
  epoch's trained batches as it always does, and the loader hands it placeholders for them
  without reading anything: the next batch is the one an uninterrupted run trains next.

With ``ignore_data_skip=True`` the loader state is not loaded: the resumed epoch starts at
its beginning, as that option means.

Only this module imports ``transformers``; ``streamcache`` does not depend on it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

from torch.utils.data import IterableDataset
from transformers import Trainer
from transformers.trainer_utils import get_last_checkpoint

from ..errors import ConfigError, LoaderStateError
from ..loading.loader import StreamLoader
from ..remote.storage import UnreadableFileError, read_regular_local, write_atomic_local

#: The loader's state in each of the Trainer's checkpoint folders.
LOADER_STATE_NAME = "streamcache_loader.json"
_TRAINER_STATE_NAME = "trainer_state.json"
#: Cap of streamcache_loader.json. A single dataset's state is a few kilobytes; a mixture's
#: grows about 300 bytes a source (0.9 MB for 3,000 sources; 1 MiB was passed at 3,500), and
#: a mixture has at most 65,536 sources (a share each of MAX_PERIOD): 64 MiB holds them all
#: at up to 1 KB each.
_MAX_STATE_BYTES = 64 << 20
#: Cap of the Trainer's trainer_state.json, which grows with its ``log_history`` (about
#: 150 bytes a logged step at ``logging_steps=1``, more with evaluations): 256 MiB holds
#: about 1.7 million logged steps, beyond any run resumed from one folder; the Trainer reads
#: the whole file itself right after, so it costs no memory the resume would not.
_MAX_TRAINER_STATE_BYTES = 256 << 20
_STATE_VERSION = 1


class TrainerLoader:
    """What the Trainer iterates: the StreamLoader's batches (only ``model_inputs``, when
    given; else without streamcache's ``__*__`` keys), plus the attributes that
    ``accelerate.skip_first_batches`` reads when the Trainer skips the batches a resumed epoch
    has trained (see :class:`_Skipped`)."""

    # DataLoader attributes skip_first_batches copies; None/0: nothing for it to redo
    batch_size = None
    drop_last = False
    num_workers = 0
    prefetch_factor = None
    collate_fn = None
    pin_memory = False

    def __init__(self, loader: StreamLoader, model_inputs: Sequence[str] | None) -> None:
        self.loader = loader
        self.model_inputs = None if model_inputs is None else tuple(model_inputs)
        self.skipped = 0  # placeholders owed to the Trainer's skip of a resumed epoch
        self.dataset = _Skipped(self)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield self._inputs(batch)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def _inputs(self, batch: Any) -> Any:
        if not isinstance(batch, dict):
            return batch
        if self.model_inputs is None:  # streamcache's own keys are no model's inputs
            return {k: v for k, v in batch.items()
                    if not (k.startswith("__") and k.endswith("__"))}
        missing = [name for name in self.model_inputs if name not in batch]
        if missing:
            raise ConfigError(f"model_inputs names {missing}, which the batches do not have "
                              f"(they have {sorted(batch)})")
        return {name: batch[name] for name in self.model_inputs}


class _Skipped(IterableDataset):
    """The Trainer resumes an epoch by iterating ``skip_first_batches(loader, n)``: a
    DataLoader over ``loader.dataset`` that drops the first ``n`` items. Here those are
    ``n`` placeholders (the loader's state already starts after them), then the batches."""

    def __init__(self, owner: TrainerLoader) -> None:
        self.owner = owner

    def __iter__(self) -> Iterator[Any]:
        skipped, self.owner.skipped = self.owner.skipped, 0
        for _ in range(skipped):
            yield None
        yield from self.owner

    def __len__(self) -> int:
        return len(self.owner)


class StreamTrainerMixin:
    """Mix into a ``transformers.Trainer`` (or a subclass such as TRL's) before it:
    ``class MyTrainer(StreamTrainerMixin, SFTTrainer)``. See the module docstring.

    Args (keyword, besides the Trainer's own):
        train_loader: the :class:`~streamcache.StreamLoader` to train on.
        model_inputs: the batch keys the model takes (None: every key but streamcache's
            own ``__id__``, ``__seed__``, ``__padding__``, ``__source__``).
    """

    args: Any
    state: Any

    def __init__(self, *args: Any, train_loader: StreamLoader,
                 model_inputs: Sequence[str] | None = None, **kwargs: Any) -> None:
        if not isinstance(train_loader, StreamLoader):
            raise ConfigError(f"train_loader must be a StreamLoader, got "
                              f"{type(train_loader).__name__}")
        super().__init__(*args, **kwargs)
        self.train_loader = TrainerLoader(train_loader, model_inputs)

    def get_train_dataloader(self) -> Any:
        return self.train_loader

    def num_examples(self, dataloader: Any) -> int:
        """The samples of an epoch of the train loader (its steps times the global batch),
        from which the Trainer counts ``train_samples_per_second``; another loader's (an
        evaluation's) as the Trainer counts them."""
        if dataloader is self.train_loader:
            return len(self.train_loader) * self._global_batch()
        return int(super().num_examples(dataloader))  # type: ignore[misc]

    def get_total_train_batch_size(self, args: Any) -> int:
        """The samples of one optimizer step over all ranks: the loader's global batch times
        ``gradient_accumulation_steps`` (``per_device_train_batch_size`` does not apply:
        the loader's dataset sets the batch)."""
        return self._global_batch() * int(args.gradient_accumulation_steps)

    def _global_batch(self) -> int:
        return int(self.train_loader.loader.dataset.global_batch)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)  # type: ignore[misc]
        if _internal_call and output_dir is not None and self.args.should_save:
            write_loader_state(output_dir, self.train_loader.loader, self.state.global_step)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise LoaderStateError(f"no checkpoint to resume from in {self.args.output_dir}")
        if isinstance(resume_from_checkpoint, str) and not self.args.ignore_data_skip:
            self.train_loader.skipped = restore_loader(
                resume_from_checkpoint, self.train_loader.loader,
                self.args.gradient_accumulation_steps)
        return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]


class StreamTrainer(StreamTrainerMixin, Trainer):
    """``transformers.Trainer`` over a :class:`~streamcache.StreamLoader`
    (:class:`StreamTrainerMixin`)."""


def write_loader_state(folder: str, loader: StreamLoader, global_step: int) -> None:
    """Publish ``loader``'s state in a Trainer checkpoint folder (atomically)."""
    os.makedirs(folder, exist_ok=True)
    document = {"version": _STATE_VERSION, "global_step": int(global_step),
                "loader": loader.state_dict()}
    write_atomic_local(os.path.join(folder, LOADER_STATE_NAME),
                       json.dumps(document, indent=1).encode())


def restore_loader(checkpoint: str, loader: StreamLoader, accumulation: int) -> int:
    """Load the loader state of the Trainer checkpoint ``checkpoint`` into ``loader``;
    returns the batches of its epoch the Trainer will skip (the loader starts after them).

    Raises:
        LoaderStateError: either file (the loader state, ``trainer_state.json``) is
            missing, not a regular file (a FIFO is refused at once), too large, not JSON or
            nested too deeply, or the loader state is malformed, or it is not where the
            Trainer's ``global_step`` puts the job.
        CursorMismatchError: the state belongs to another dataset, seed or shuffle.
    """
    document = _read_json(os.path.join(checkpoint, LOADER_STATE_NAME), "the loader state",
                          _MAX_STATE_BYTES)
    if not isinstance(document, dict) or document.get("version") != _STATE_VERSION or \
            set(document) != {"version", "global_step", "loader"}:
        raise LoaderStateError(f"{checkpoint}/{LOADER_STATE_NAME} is not a loader state of "
                               "this version")
    trainer_state = _read_json(os.path.join(checkpoint, _TRAINER_STATE_NAME), "its state",
                               _MAX_TRAINER_STATE_BYTES)
    global_step = trainer_state.get("global_step") if isinstance(trainer_state, dict) else None
    if global_step != document["global_step"]:
        raise LoaderStateError(
            f"{checkpoint}: the loader state was saved at step {document['global_step']} but "
            f"the Trainer's state is at step {global_step}; the folder mixes two checkpoints")
    loader.validate_state_dict(document["loader"])
    loader.load_state_dict(document["loader"])
    return _check_position(loader, int(global_step), accumulation, checkpoint)


def _check_position(loader: StreamLoader, global_step: int, accumulation: int,
                    checkpoint: str) -> int:
    """The batches the Trainer skips in the resumed epoch, checked against the loader's
    cursor (the Trainer counts them from ``global_step``, the loader from its state)."""
    steps = len(loader)
    per_epoch = max(steps // accumulation + int(steps % accumulation > 0), 1)
    epoch, skipped = divmod(global_step, per_epoch)
    skipped *= accumulation
    cursor = loader.cursor
    global_batch = loader.dataset.global_batch
    done = cursor.samples_consumed // global_batch
    if (cursor.epoch, done) != (epoch, skipped):
        raise LoaderStateError(
            f"{checkpoint}: the Trainer resumes at epoch {epoch}, batch {skipped} (step "
            f"{global_step}, {per_epoch} optimizer steps an epoch) but the loader state is at "
            f"epoch {cursor.epoch}, batch {done}: the global batch, the dataset or "
            "gradient_accumulation_steps changed since it was saved; keep them, or resume "
            "with ignore_data_skip=True to start the epoch over")
    return skipped


def _read_json(path: str, what: str, limit: int) -> Any:
    """The JSON document in the file ``path`` (``what`` it holds, for the message).

    Raises:
        LoaderStateError: the file is missing, not a regular file (a FIFO is refused without
            waiting for a writer), larger than ``limit`` bytes, not JSON, or nested too
            deeply to decode.
    """
    data = _read_regular_file(path, what, limit)
    try:
        return json.loads(data)
    except ValueError as error:
        raise LoaderStateError(f"{path} is not valid JSON ({error}): it is damaged; resume "
                               "from another checkpoint") from None
    except RecursionError:
        raise LoaderStateError(f"{path} is nested too deeply to be a checkpoint's state: "
                               "it is damaged; resume from another checkpoint") from None


def _read_regular_file(path: str, what: str, limit: int) -> bytes:
    """At most ``limit`` bytes of the regular file ``path`` (links followed: a checkpoint
    folder may be a copy made of links), through
    :func:`~streamcache.remote.storage.read_regular_local` (a FIFO is refused, not waited on).

    Raises:
        LoaderStateError: missing, not a regular file, unreadable, or larger than ``limit``.
    """
    try:
        data = read_regular_local(path, limit, follow_links=True)
    except FileNotFoundError:
        raise LoaderStateError(
            f"{path} is missing: the checkpoint was not written by a StreamTrainer, so "
            f"{what} cannot be restored exactly; resume with ignore_data_skip=True to start "
            "the epoch over") from None
    except UnreadableFileError:
        raise LoaderStateError(f"{path} is not a regular file: replace it with the file "
                               "the checkpoint was saved with, or resume from another "
                               "checkpoint") from None
    except OSError as error:
        raise _unreadable(path, error) from None
    if len(data) > limit:
        raise LoaderStateError(f"{path} is larger than {limit} bytes: it is not a "
                               "checkpoint's state; resume from another checkpoint")
    return data


def _unreadable(path: str, error: OSError) -> LoaderStateError:
    return LoaderStateError(f"{path} cannot be read ({error.strerror}): fix it, or resume "
                            "from another checkpoint")


__all__ = [
    "LOADER_STATE_NAME",
    "LoaderStateError",
    "StreamTrainer",
    "StreamTrainerMixin",
    "TrainerLoader",
    "restore_loader",
    "write_loader_state",
]
