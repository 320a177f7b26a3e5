"""The user's prompts: a job's ``data:`` section read with ``datasets``, tokenized with the
actor's tokenizer (``transformers``, local files only), visited epoch by epoch in a seeded
order, and handed to the controller as left-padded batches.

Everything here runs on the driver before any worker starts, so a missing column, an empty
file or a prompt over the limit is reported in one line naming the file and the row.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from executor.batch import Batch
from profiles.datafile import SpecError, check_regular_file, read_text_file
from simulator.specs.data import DATA_SUFFIXES, DataSpec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                   "vocab.json")
"""A directory holding any of these has a tokenizer to compare and to copy."""


def load_tokenizer(directory: str | Path, *, key: str) -> Any:
    """A Hugging Face tokenizer from a local directory (nothing is downloaded)."""
    from transformers import AutoTokenizer

    path = Path(directory)
    if not path.is_dir():
        raise SpecError(f"not a directory: {path}", key=key)
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        raise SpecError(f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES)})",
                        key=key)
    for file in sorted(path.glob("*.json")):
        # transformers reports a broken JSON file without its name; name it.
        try:
            json.loads(read_text_file(file, what="UTF-8 JSON"))
        except json.JSONDecodeError as exc:
            raise SpecError(f"{file}: not valid JSON: line {exc.lineno}: {exc.msg}",
                            key=key) from None
        except SpecError as exc:
            raise SpecError(f"{file}: {exc.problem}", key=key) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise SpecError(f"{path}: the tokenizer does not load: "
                        f"{str(exc).splitlines()[0]}", key=key) from None
    if tokenizer.eos_token_id is None:
        raise SpecError(f"{path}: the tokenizer has no end-of-sequence token (eos_token)",
                        key=key)
    return tokenizer


def has_tokenizer(directory: str | Path) -> bool:
    return any((Path(directory) / name).exists() for name in TOKENIZER_FILES)


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers turn text into the same ids (vocabulary and special tokens)."""
    return (a.get_vocab() == b.get_vocab() and a.eos_token_id == b.eos_token_id
            and a.bos_token_id == b.bos_token_id)


@dataclass(frozen=True)
class PromptTable:
    """Tokenized prompts of some files, with the rows they came from."""

    token_ids: tuple[tuple[int, ...], ...]
    texts: tuple[str, ...]
    """Each prompt as the model reads it (the chat template rendered)."""
    rows: tuple[dict[str, Any], ...]
    """The data rows (for the user's reward function), with ``_file`` and ``_row``."""
    dropped: int = 0
    """Rows left out by the ``filter`` policy."""
    truncated: int = 0
    """Prompts shortened by the ``truncate`` policy."""

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def longest(self) -> int:
        return max(len(t) for t in self.token_ids)


def _read_rows(path: str, key: str) -> list[dict[str, Any]]:
    """Every row of a JSONL or Parquet file as a dict."""
    from datasets import load_dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    builder = DATA_SUFFIXES[Path(path).suffix.lower()]
    if builder == "json":
        _check_jsonl(path, key)
    try:
        table = load_dataset(builder, data_files=[path], split="train")
    except Exception as exc:  # datasets wraps the reader's errors in several types
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SpecError(f"{path}: not a readable {builder} file: {message}",
                        key=key) from None
    if len(table) == 0:
        raise SpecError(f"{path}: no rows", key=key)
    return [dict(row) for row in table]


def _check_jsonl(path: str, key: str) -> None:
    """One JSON object per line; the first bad line is named (``datasets`` reports only that
    the file failed)."""
    try:
        check_regular_file(path)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc.problem}", key=key) from None
    rows = 0
    # Line by line: a training set may be far larger than memory wants to hold twice.
    try:
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                if not rows and Path(path).suffix.lower() == ".json" and \
                        line.lstrip().startswith("["):
                    return  # a JSON array of objects
                rows += 1
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise SpecError(f"{path}: line {number}: not valid JSON ({exc.msg})",
                                    key=key) from None
                if not isinstance(value, dict):
                    raise SpecError(f"{path}: line {number}: expected a JSON object per "
                                    "line", key=key)
    except UnicodeDecodeError:
        raise SpecError(f"{path}: not a text file (expected UTF-8 JSON lines)",
                        key=key) from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read: {exc.strerror or exc}", key=key) from None
    if not rows:
        raise SpecError(f"{path}: no rows", key=key)


def _render(tokenizer: Any, value: Any, spec: DataSpec, where: str) -> tuple[list[int], str]:
    """A prompt's token ids and text: a string as it is (or as one user message of the chat
    template), a list of messages through the chat template with the assistant's header."""
    if isinstance(value, str):
        if not spec.chat_template:
            ids = tokenizer(value, add_special_tokens=True)["input_ids"]
            return list(ids), value
        value = [{"role": "user", "content": value}]
    if not (isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in value)):
        raise SpecError(f"{where}: expected a string or a list of chat messages "
                        f"({{role, content}}), got {str(value)[:60]!r}",
                        key=f"data.prompt_key {spec.prompt_key}")
    if not getattr(tokenizer, "chat_template", None):
        raise SpecError(f"{where}: the prompt is a list of chat messages but the tokenizer has "
                        "no chat template", key="data.prompt_key")
    text = tokenizer.apply_chat_template(value, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return list(ids), text


def tokenize_files(tokenizer: Any, files: Sequence[str], spec: DataSpec, *, limit: int,
                   key: str) -> PromptTable:
    """Read and tokenize ``files`` under the prompt-length ``limit`` and the spec's policy."""
    token_ids: list[tuple[int, ...]] = []
    texts: list[str] = []
    rows: list[dict[str, Any]] = []
    dropped = truncated = 0
    for index, path in enumerate(files):
        file_key = f"{key}[{index}]"
        for number, row in enumerate(_read_rows(path, file_key)):
            where = f"{path}: row {number}"
            if spec.prompt_key not in row:
                raise SpecError(f"{where}: no column {spec.prompt_key!r} (columns: "
                                f"{', '.join(sorted(row))})", key="data.prompt_key")
            ids, text = _render(tokenizer, row[spec.prompt_key], spec, where)
            if not ids:
                raise SpecError(f"{where}: the prompt is empty", key="data.prompt_key")
            if len(ids) > limit:
                if spec.prompt_too_long == "error":
                    raise SpecError(f"{where}: the prompt has {len(ids)} tokens, more than "
                                    f"max_prompt_length {limit} (prompt_too_long: error; "
                                    "truncate or filter take it)",
                                    key="data.max_prompt_length")
                if spec.prompt_too_long == "filter":
                    dropped += 1
                    continue
                ids = ids[-limit:]  # keep the end: the question and the assistant header
                truncated += 1
            token_ids.append(tuple(ids))
            texts.append(text)
            rows.append({**row, "_file": path, "_row": number})
    if not token_ids:
        raise SpecError(f"every row is longer than max_prompt_length {limit} and "
                        "prompt_too_long is filter: no prompt is left", key=key)
    return PromptTable(token_ids=tuple(token_ids), texts=tuple(texts), rows=tuple(rows),
                       dropped=dropped, truncated=truncated)


class DataExhaustedError(RuntimeError):
    """Every epoch of the training rows has been used."""


@dataclass
class DataCursor:
    """Where the run is in its data: epoch and offset into that epoch's seeded order. Its
    ``state`` is plain data (the run records it every iteration; a resumed run restores it
    and neither repeats nor skips a prompt)."""

    rows: int
    epochs: int
    seed: int
    shuffle: bool
    epoch: int = 0
    offset: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def order(self, epoch: int) -> list[int]:
        indices = list(range(self.rows))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(indices)
        return indices

    def take(self, count: int) -> list[int]:
        """The next ``count`` row indices, crossing into the next epoch when one ends. When
        fewer remain the position stays where it is and DataExhaustedError is raised (a
        batch is never cut short)."""
        remaining = (self.epochs - self.epoch) * self.rows - self.offset
        if remaining < count:
            raise DataExhaustedError(
                f"the {self.rows} training rows are used up after {self.epochs} epoch(s) "
                f"(data.epochs; {remaining} left, {count} needed per iteration)")
        out: list[int] = []
        while len(out) < count:
            if not self._order:
                self._order = self.order(self.epoch)
            need = count - len(out)
            chunk = self._order[self.offset:self.offset + need]
            out.extend(chunk)
            self.offset += len(chunk)
            if self.offset >= self.rows:
                self.epoch += 1
                self.offset = 0
                self._order = []
        return out

    @property
    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "rows": self.rows,
                "seed": self.seed}

    def restore(self, state: dict[str, int]) -> None:
        if state.get("rows") != self.rows or state.get("seed") != self.seed:
            raise SpecError(f"the saved data position is for {state.get('rows')} rows and seed "
                            f"{state.get('seed')}; this data has {self.rows} rows and seed "
                            f"{self.seed}", key="data")
        self.epoch, self.offset, self._order = int(state["epoch"]), int(state["offset"]), []


def left_padded(token_ids: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor,
                                                                      torch.Tensor]:
    """Prompts of different lengths as one (batch, longest) tensor, padded on the left, and
    the mask of the real tokens."""
    width = max(len(t) for t in token_ids)
    ids = torch.full((len(token_ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(token_ids), width), dtype=torch.long)
    for i, tokens in enumerate(token_ids):
        if tokens:
            ids[i, width - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
            mask[i, width - len(tokens):] = 1
    return ids, mask


@dataclass
class DatasetTask:
    """Prompts from the user's data, for the controller's programs (the counterpart of the
    built-in ``SortDigits``): no rule of its own; the reward comes from the user's reward
    function or a reward model."""

    tokenizer: Any
    train: PromptTable
    cursor: DataCursor
    val: PromptTable | None = None
    tokenizer_directory: str = ""
    has_rule: bool = False

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(self.eos_token_id if pad is None else pad)

    @property
    def vocab_needed(self) -> int:
        return len(self.tokenizer)

    @property
    def prompt_length(self) -> int:
        """The longest prompt, in tokens."""
        return max(self.train.longest, self.val.longest if self.val else 0)

    def prompt_batch(self, count: int, generator: torch.Generator | None = None) -> Batch:
        """The next ``count`` training prompts (``generator`` is not used: the order is the
        data's seeded order)."""
        return self._batch(self.train, self.cursor.take(count))

    def held_out_batch(self, count: int) -> Batch | None:
        if self.val is None:
            return None
        return self._batch(self.val, list(range(min(count, len(self.val)))), held_out=True)

    def _batch(self, table: PromptTable, indices: list[int], held_out: bool = False) -> Batch:
        ids, mask = left_padded([table.token_ids[i] for i in indices], self.pad_token_id)
        index = torch.tensor(indices, dtype=torch.long)
        if held_out:
            index = -1 - index  # validation rows are -1, -2, ...
        return Batch({"prompts": ids, "prompt_mask": mask, "prompt_index": index})

    def rows(self, batch: Batch) -> list[dict[str, Any]]:
        return [self._table(int(i))[1].rows[self._table(int(i))[0]]
                for i in batch["prompt_index"].tolist()]

    def prompt_texts(self, batch: Batch) -> list[str]:
        return [self._table(int(i))[1].texts[self._table(int(i))[0]]
                for i in batch["prompt_index"].tolist()]

    def _table(self, index: int) -> tuple[int, PromptTable]:
        if index < 0:
            assert self.val is not None
            return -1 - index, self.val
        return index, self.train

    def response_texts(self, responses: torch.Tensor) -> list[str]:
        """Each response decoded up to its end-of-sequence token."""
        out = []
        for tokens in responses.tolist():
            if self.eos_token_id in tokens:
                tokens = tokens[:tokens.index(self.eos_token_id)]
            out.append(self.tokenizer.decode(tokens, skip_special_tokens=True))
        return out


def build_dataset_task(spec: DataSpec, tokenizer_directory: str, *,
                       max_prompt_length: int) -> DatasetTask:
    """Tokenizer, training and validation prompts, and the cursor of a job's ``data:``."""
    tokenizer = load_tokenizer(tokenizer_directory, key="data.tokenizer")
    limit = spec.max_prompt_length or max_prompt_length
    train = tokenize_files(tokenizer, spec.train_files, spec, limit=limit,
                           key="data.train_files")
    val = tokenize_files(tokenizer, spec.val_files, spec, limit=limit,
                         key="data.val_files") if spec.val_files else None
    cursor = DataCursor(rows=len(train), epochs=spec.epochs, seed=spec.seed,
                        shuffle=spec.shuffle)
    return DatasetTask(tokenizer=tokenizer, train=train, cursor=cursor, val=val,
                       tokenizer_directory=str(tokenizer_directory))
