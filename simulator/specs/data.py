"""DataSpec: the ``data:`` section of a job, where ``hybridflow execute`` takes its prompts from.

The planner prices the workload's ``prompt_length`` (the executor checks the data against it);
the executor reads the files with the ``datasets`` library and tokenizes them with the
actor's tokenizer. This module only describes and checks the section: nothing here reads
the data (it must import without the executor's dependencies).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from profiles.datafile import SpecError, from_mapping, require

DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""File suffix -> the ``datasets`` builder that reads it."""

PromptTooLong = Literal["error", "truncate", "filter"]


@dataclass(kw_only=True, slots=True, frozen=True)
class DataSpec:
    """Where the prompts come from and how they become token ids."""

    train_files: tuple[str, ...]
    """JSONL (one JSON object per line) or Parquet files of prompts; relative paths are
    relative to the job file."""
    val_files: tuple[str, ...] = ()
    """Held-out prompts for the validation reward (``execute --validate-every``)."""
    prompt_key: str = "prompt"
    """The column holding the prompt: a string, or a list of chat messages
    (``[{role, content}, ...]``) rendered with the tokenizer's chat template."""
    chat_template: bool | None = None
    """Render string prompts through the chat template too, as one user message (None: only
    message lists are)."""
    tokenizer: str | None = None
    """A local directory with the tokenizer files (default: the actor's checkpoint
    directory); nothing is downloaded."""
    max_prompt_length: int | None = None
    """Longest prompt in tokens (default: the workload's prompt_length)."""
    prompt_too_long: PromptTooLong = "error"
    """What a longer prompt gets: error (the run is refused, naming the file and row),
    truncate (its first tokens are dropped, the end kept: the question and the chat
    template's assistant header stay), or filter (the row is left out)."""
    shuffle: bool = True
    """Visit the rows in a new random order every epoch."""
    seed: int = 0
    """Seed of the shuffling (epoch e uses seed + e)."""
    epochs: int = 1
    """Passes over the training rows; the run ends early when they are used up."""

    def __post_init__(self) -> None:
        require(bool(self.train_files), "give at least one file", "train_files")
        for key in ("train_files", "val_files"):
            for i, name in enumerate(getattr(self, key)):
                suffix = Path(name).suffix.lower()
                require(suffix in DATA_SUFFIXES,
                        f"{name}: expected a {', '.join(DATA_SUFFIXES)} file", f"{key}[{i}]")
        require(bool(self.prompt_key), "must name a column", "prompt_key")
        require(self.max_prompt_length is None or self.max_prompt_length > 0,
                "must be a positive integer", "max_prompt_length")
        require(self.epochs >= 1, "must be at least 1", "epochs")

    def resolved(self, base_dir: Path | None) -> DataSpec:
        """The same section with relative paths made relative to ``base_dir``, every file
        checked to exist."""
        def resolve(name: str, key: str) -> str:
            path = Path(name)
            if base_dir is not None and not path.is_absolute():
                path = base_dir / path
            if not path.is_file():
                what = "a directory, expected a file" if path.is_dir() else "file not found"
                raise SpecError(f"{what}: {path}", key=key)
            return str(path.resolve())  # a plan that embeds the job runs from anywhere

        tokenizer = self.tokenizer
        if tokenizer is not None:
            path = Path(tokenizer)
            if base_dir is not None and not path.is_absolute():
                path = base_dir / path
            if not path.is_dir():
                raise SpecError(f"not a directory: {path}", key="data.tokenizer")
            tokenizer = str(path.resolve())
        return DataSpec(
            train_files=tuple(resolve(n, f"data.train_files[{i}]")
                              for i, n in enumerate(self.train_files)),
            val_files=tuple(resolve(n, f"data.val_files[{i}]")
                            for i, n in enumerate(self.val_files)),
            prompt_key=self.prompt_key, chat_template=self.chat_template, tokenizer=tokenizer,
            max_prompt_length=self.max_prompt_length, prompt_too_long=self.prompt_too_long,
            shuffle=self.shuffle, seed=self.seed, epochs=self.epochs)


def parse_data(value: Any, base_dir: Path | None) -> DataSpec:
    """The ``data:`` section of a job file (a single file may be a string)."""
    if not isinstance(value, dict):
        raise SpecError(f"expected a mapping with train_files, got {value!r}", key="data")
    raw = dict(value)
    for key in ("train_files", "val_files"):
        if isinstance(raw.get(key), str):
            raw[key] = [raw[key]]
    spec = from_mapping(DataSpec, raw, key_prefix="data")
    return spec.resolved(base_dir)
