"""Writing an NF4 store as a checkpoint folder (poros/store/export.py): whole or not at all. A disk that fills while
a shard is written leaves no folder, no temporary and one line naming the folder; the Unsloth method's export
(poros/harness/unsloth.py) leaves none either, kept or not."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

import poros.harness.unsloth as um
from poros.errors import PorosError, WriteError
from poros.store.build import build_store
from poros.store.export import export_bnb4bit
from tests.capabilities import requires_bitsandbytes

pytestmark = requires_bitsandbytes


@pytest.fixture(scope="module")
def store():
    built, _ = build_store("tiny-qwen3", device="cpu", progress=False)
    return built


@pytest.fixture
def filling(monkeypatch):
    """safetensors' writer on a disk that fills during the second shard: half of it lands, then ENOSPC."""
    import safetensors.torch

    real, calls = safetensors.torch.save_file, []

    def save_file(tensors, filename, metadata=None):
        calls.append(filename)
        real(tensors, filename, metadata=metadata)
        if len(calls) == 2:
            path = Path(filename)
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    return calls


def _everything(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_full_disk_mid_shard_leaves_no_folder_and_no_temporary(store, tmp_path, filling):
    with pytest.raises(WriteError) as e:
        export_bnb4bit(store, tmp_path / "export")
    assert str(e.value) == (f"cannot write the NF4 checkpoint {tmp_path / 'export'} (No space left on device); free "
                            "space; nothing of it is left behind")
    assert len(filling) == 2 and _everything(tmp_path) == [], _everything(tmp_path)


def test_an_empty_folder_given_stays_as_it_was_and_a_full_one_is_refused(store, tmp_path, filling):
    (tmp_path / "export").mkdir()
    with pytest.raises(WriteError):
        export_bnb4bit(store, tmp_path / "export")
    assert _everything(tmp_path) == ["export"]
    (tmp_path / "export" / "config.json").write_text("{}")
    with pytest.raises(PorosError, match="exists and is not an empty folder"):
        export_bnb4bit(store, tmp_path / "export")
    assert _everything(tmp_path) == ["export", "export/config.json"] and len(filling) == 2, "refused before writing"


def test_with_room_the_export_is_whole(store, tmp_path):
    """Control: the same export without the full disk writes every shard, the index and the config, nothing else."""
    folder = export_bnb4bit(store, tmp_path / "export")
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) == len(store.layers) + 1 and (folder / "model.safetensors.index.json").is_file()
    assert (folder / "config.json").is_file() and _everything(tmp_path)[0] == "export"
    assert not [p for p in tmp_path.rglob("*") if "partial" in p.name]


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "not-kept"])
def test_the_unsloth_export_on_a_full_disk_leaves_nothing_in_the_work_folder(store, tmp_path, filling, keep):
    logged = []
    with pytest.raises(WriteError, match=r"^cannot write the NF4 checkpoint .*\(No space left on device\)"):
        um._export(store, tmp_path, keep, logged.append)
    assert _everything(tmp_path) == [] and logged == []
