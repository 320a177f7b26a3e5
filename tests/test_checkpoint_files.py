"""Checkpoints are data: DCP's metadata is read with an unpickler that builds DCP's own
classes and nothing else, and a broken checkpoint or run directory is named in one line."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from executor.checkpoint import DataOnlyReader, MetadataUnpickler  # noqa: E402
from executor.run_checkpoints import (  # noqa: E402
    checkpoint_directories,
    read_controller_state,
)
from profiles.datafile import SpecError  # noqa: E402
from tests.conftest import run_cli  # noqa: E402


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_a_checkpoint_that_names_code_is_refused(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match=r"may not name posix\.system"):
        DataOnlyReader(str(tmp_path)).read_metadata()
    for payload in (pickle.dumps(print), pickle.dumps(Path.home)):
        with pytest.raises(pickle.UnpicklingError, match="may not name"):
            MetadataUnpickler(io.BytesIO(payload)).load()
    # What DCP itself writes loads (torch sizes, dtypes, its metadata classes).
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3), "step": torch.tensor(2.0)},
             checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    metadata = DataOnlyReader(str(tmp_path / "ok")).read_metadata()
    assert set(metadata.state_dict_metadata) == {"w", "step"}
    target = {"w": torch.zeros(3), "step": torch.tensor(0.0)}
    dcp.load(target, checkpoint_id=str(tmp_path / "ok"),
             storage_reader=DataOnlyReader(str(tmp_path / "ok")), no_dist=True)
    assert target["w"].tolist() == [1.0, 1.0, 1.0] and float(target["step"]) == 2.0
    # A non-tensor entry DCP would torch.load with weights_only=False: refused unread.
    dcp.save({"w": torch.ones(3), "extra": {"any": "object"}},
             checkpoint_id=str(tmp_path / "objects"), no_dist=True)
    with pytest.raises(pickle.UnpicklingError, match="not a tensor"):
        DataOnlyReader(str(tmp_path / "objects")).read_metadata()


def test_partial_and_broken_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    (root / ".iter_000004.partial").mkdir(parents=True)  # a write that never finished
    (root / "iter_000002").mkdir()
    (root / "iter_000002" / "controller.json").write_text(json.dumps(
        {"iterations_done": 2, "generator": [], "rows": [], "metrics": []}))
    (root / "iter_000003").mkdir()  # no controller.json: not complete
    assert [p.name for p in checkpoint_directories(tmp_path)] == ["iter_000002"]
    (root / "iter_000002" / "controller.json").write_text("{truncated")
    with pytest.raises(SpecError, match="not a readable checkpoint"):
        read_controller_state(root / "iter_000002")
    (root / "iter_000002" / "controller.json").write_text("{}")
    with pytest.raises(SpecError, match="iterations_done: missing key"):
        read_controller_state(root / "iter_000002")


@pytest.mark.parametrize(("setup", "problem"), [
    (lambda run: None, "meta.json: file not found"),
    (lambda run: (run / "meta.json").write_text("{not json"), "not valid JSON"),
    (lambda run: (run / "meta.json").write_text('{"plan": {}}'), "job: missing key"),
])
def test_resume_of_a_bad_run_directory_is_one_line(tmp_path: Path, setup, problem) -> None:
    run = tmp_path / "run"
    run.mkdir()
    setup(run)
    result = run_cli(["execute", "--resume", str(run)])
    assert result.returncode == 2, result.stderr
    assert problem in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
