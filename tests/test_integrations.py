"""The Trainer integration's inputs, adversarially: a checkpoint's loader state that is
missing, too large, malformed, from another checkpoint, another dataset or another global
batch; either file of the checkpoint (the loader state, the Trainer's own state) replaced by
a FIFO, a folder or deeply nested JSON; a long run's large ``trainer_state.json``; and the
batches it hands the model. (The SIGKILL and resume run is tests/test_hf_trainer.py.)"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from loader_helpers import make_dataset

from streamcache import ConfigError, CursorMismatchError, StreamDataset, StreamLoader

transformers_integration = pytest.importorskip("streamcache.integrations.transformers")
LoaderStateError = transformers_integration.LoaderStateError
restore_loader = transformers_integration.restore_loader
write_loader_state = transformers_integration.write_loader_state

STEPS = 15  # 240 samples, global batch 16


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    folder = str(tmp_path_factory.mktemp("integrations"))
    return make_dataset(folder, [120, 120], seq=False), folder + "/cache"


def _loader(data: tuple[str, str], seed: int = 11, batch: int = 16) -> StreamLoader:
    url, cache = data
    return StreamLoader(StreamDataset(url, global_batch_size=batch, seed=seed, rank=0,
                                      world_size=1, cache_dir=cache))


def _checkpoint(tmp_path: Path, data: tuple[str, str], trained: int, global_step: int,
                accumulation: int = 2) -> Path:
    """A checkpoint folder as StreamTrainer writes it after ``trained`` batches."""
    folder = tmp_path / f"checkpoint-{global_step}"
    with _loader(data) as loader:
        left = trained
        while left:  # across epochs, as the Trainer iterates the loader once per epoch
            for _ in loader:
                left -= 1
                if not left:
                    break
        write_loader_state(str(folder), loader, global_step)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": global_step}))
    return folder


def test_a_consistent_checkpoint_restores_the_cursor(tmp_path: Path,
                                                     data: tuple[str, str]) -> None:
    # 8 optimizer steps an epoch (15 batches, accumulation 2): step 9 = epoch 1, 2 batches in
    folder = _checkpoint(tmp_path, data, STEPS + 2, 9)
    with _loader(data) as loader:
        assert restore_loader(str(folder), loader, 2) == 2
        assert (loader.epoch, loader.cursor.samples_consumed) == (1, 32)


def test_a_missing_state_says_what_to_do(tmp_path: Path, data: tuple[str, str]) -> None:
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    with _loader(data) as loader, pytest.raises(LoaderStateError, match="ignore_data_skip"):
        restore_loader(str(folder), loader, 1)


@pytest.mark.parametrize("content", [
    b"not json",
    b'{"version": 2, "global_step": 3, "loader": {}}',
    b'{"version": 1, "global_step": 3}',
    b'{"version": 1, "global_step": 3, "loader": {}, "extra": 1}',
    b"[" * 100 + b"]" * 100,
    b"[" * 100_000,
    b" " * ((1 << 20) + 1),
], ids=["not-json", "version-2", "no-loader", "extra-key", "nested-list", "deep-list",
        "blank-1MiB"])
def test_a_malformed_state_is_refused_and_changes_nothing(tmp_path: Path, data: tuple[str, str],
                                                          content: bytes) -> None:
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    (folder / "streamcache_loader.json").write_bytes(content)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    with _loader(data) as loader:
        before = loader.state_dict()
        with pytest.raises(LoaderStateError):
            restore_loader(str(folder), loader, 1)
        assert loader.state_dict() == before


def test_a_state_of_another_checkpoint_is_refused(tmp_path: Path, data: tuple[str, str]) -> None:
    folder = _checkpoint(tmp_path, data, 6, 3)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 6}))
    with _loader(data) as loader, pytest.raises(LoaderStateError, match="mixes two checkpoints"):
        restore_loader(str(folder), loader, 2)


def test_a_state_of_another_seed_is_refused_and_changes_nothing(tmp_path: Path,
                                                                data: tuple[str, str]) -> None:
    folder = _checkpoint(tmp_path, data, 6, 3)
    with _loader(data, seed=12) as loader:
        before = loader.state_dict()
        with pytest.raises(CursorMismatchError, match="seed"):
            restore_loader(str(folder), loader, 2)
        assert loader.state_dict() == before


@pytest.mark.parametrize(("accumulation", "batch"), [(1, 16), (2, 8)])
def test_a_changed_accumulation_or_global_batch_is_refused(
        tmp_path: Path, data: tuple[str, str], accumulation: int, batch: int) -> None:
    folder = _checkpoint(tmp_path, data, 6, 3)  # saved with accumulation 2, global batch 16
    with _loader(data, batch=batch) as loader, \
            pytest.raises(LoaderStateError, match="gradient_accumulation_steps changed"):
        restore_loader(str(folder), loader, accumulation)


def test_a_long_runs_trainer_state_resumes(tmp_path: Path, data: tuple[str, str]) -> None:
    # ~10k optimizer steps at logging_steps=1: the Trainer's own file passes 1 MiB (#33)
    from transformers.trainer_callback import TrainerState

    folder = _checkpoint(tmp_path, data, STEPS + 2, 9)
    log = [{"epoch": step / 8, "grad_norm": 1.2345678, "learning_rate": 4.99e-05,
            "loss": 2.345678, "step": step} for step in range(1, 10_001)]
    TrainerState(global_step=9, max_steps=10_000, log_history=log).save_to_json(
        str(folder / "trainer_state.json"))
    assert (folder / "trainer_state.json").stat().st_size > 1 << 20
    with _loader(data) as loader:
        assert restore_loader(str(folder), loader, 2) == 2
        assert (loader.epoch, loader.cursor.samples_consumed) == (1, 32)


def test_a_large_mixtures_loader_state_resumes(tmp_path: Path, data: tuple[str, str]) -> None:
    # a mixture's state grows ~300 bytes a source: 2 MiB is ~7,000 sources (#33: 1 MiB cap)
    folder = _checkpoint(tmp_path, data, STEPS + 2, 9)
    state = folder / "streamcache_loader.json"
    state.write_bytes(state.read_bytes() + b" " * (2 << 20))
    with _loader(data) as loader:
        assert restore_loader(str(folder), loader, 2) == 2


@pytest.mark.parametrize(("name", "cap"), [("streamcache_loader.json", "_MAX_STATE_BYTES"),
                                           ("trainer_state.json", "_MAX_TRAINER_STATE_BYTES")])
def test_a_file_over_its_cap_is_refused(tmp_path: Path, data: tuple[str, str],
                                        monkeypatch: pytest.MonkeyPatch, name: str,
                                        cap: str) -> None:
    folder = _checkpoint(tmp_path, data, 6, 3)
    monkeypatch.setattr(transformers_integration, cap, (folder / name).stat().st_size - 1)
    with _loader(data) as loader, pytest.raises(LoaderStateError, match="larger than"):
        restore_loader(str(folder), loader, 2)


def _restore_in_thread(folder: Path, loader: StreamLoader, unblock: Path) -> BaseException:
    """What ``restore_loader`` raised, run in a thread so that a blocking read fails the
    test instead of hanging it (``unblock``, a FIFO, is then opened to release it)."""
    outcome: list[BaseException | None] = []

    def restore() -> None:
        try:
            restore_loader(str(folder), loader, 2)
            outcome.append(None)
        except BaseException as error:  # (handed to the test)
            outcome.append(error)

    thread = threading.Thread(target=restore, name="restore-loader", daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive() and unblock.exists():
        os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))  # the reader's open returns
        thread.join(60)
    assert outcome, "restore_loader blocked"
    assert outcome[0] is not None, "restore_loader accepted it"
    return outcome[0]


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _deep(path: Path) -> None:
    path.write_bytes(b"[" * 100_000 + b"]" * 100_000)


@pytest.mark.parametrize("name", ["streamcache_loader.json", "trainer_state.json"])
@pytest.mark.parametrize(("replace", "message"), [
    (_fifo, "not a regular file"), (_folder, "not a regular file"), (_deep, "nested")],
    ids=["fifo", "folder", "deep-json"])
def test_a_file_of_the_checkpoint_that_is_no_file_or_too_deep_is_refused_promptly(
        tmp_path: Path, data: tuple[str, str], name: str, replace: Any, message: str) -> None:
    folder = _checkpoint(tmp_path, data, 6, 3)
    replace(folder / name)
    with _loader(data) as loader:
        before = loader.state_dict()
        error = _restore_in_thread(folder, loader, folder / name)
        assert isinstance(error, LoaderStateError), repr(error)
        assert message in str(error) and name in str(error)
        assert loader.state_dict() == before


def test_model_inputs_select_the_keys_and_name_what_is_missing(data: tuple[str, str]) -> None:
    TrainerLoader = transformers_integration.TrainerLoader
    with _loader(data) as loader:
        default = next(iter(TrainerLoader(loader, None)))
        assert set(default) == {"x"}  # streamcache's __id__ is no model input
        chosen = next(iter(TrainerLoader(loader, ["x", "__id__"])))
        assert set(chosen) == {"x", "__id__"}
        with pytest.raises(ConfigError, match=r"model_inputs names \['labels'\]"):
            next(iter(TrainerLoader(loader, ["x", "labels"])))


def test_stream_trainer_takes_a_stream_loader_only(tmp_path: Path) -> None:
    import torch
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    with pytest.raises(ConfigError, match="train_loader must be a StreamLoader"):
        transformers_integration.StreamTrainer(model=torch.nn.Linear(1, 1), args=args,
                                               train_loader=[1, 2, 3])
    assert not os.path.exists(tmp_path / "out" / "checkpoint-1")


class _Regression:
    """A model the Trainer can train on batches of ``x``: the loss of fitting x to itself."""

    @staticmethod
    def make() -> Any:
        import torch

        class Regression(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.net = torch.nn.Linear(1, 1)

            def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
                x = x.float().unsqueeze(1) / 240
                return {"loss": ((self.net(x) - x) ** 2).mean()}

        return Regression()


@pytest.fixture
def fresh_accelerate_state() -> Any:
    """The Trainer makes Accelerate's shared state in this process; reset it afterwards so
    that no other test inherits it."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")  # transformers'
@pytest.mark.parametrize(("accumulation", "schedule"), [
    (1, {"num_train_epochs": 1}),  # the Trainer counts the epoch's samples
    (2, {"max_steps": 3}),  # the Trainer counts the steps' global batches
])
def test_the_trainers_samples_per_second_counts_samples(
        tmp_path: Path, data: tuple[str, str], fresh_accelerate_state: Any, accumulation: int,
        schedule: dict[str, Any]) -> None:
    """train_samples_per_second was train_steps_per_second: the Trainer took the length of
    the loader (steps) for its samples, or per_device_train_batch_size for its batch."""
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[],
                             save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             gradient_accumulation_steps=accumulation, **schedule)
    with _loader(data) as loader:
        trainer = transformers_integration.StreamTrainer(
            model=_Regression.make(), args=args, train_loader=loader, model_inputs=["x"])
        metrics = trainer.train().metrics
    samples_per_step = metrics["train_samples_per_second"] / metrics["train_steps_per_second"]
    assert samples_per_step == pytest.approx(16 * accumulation, rel=0.02)
