"""The gate against a reference kept as digests (poros/engine/parity_digest.py), as a run in parts uses it: saved
and loaded again, it PASSes where the reference's recorded states do and FAILs where they do, naming the tensor."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from poros.config import TrainConfig
from poros.engine.parity_digest import DigestReference, DigestsRefused, tensor_digest
from poros.errors import PorosError

FP = "0123456789abcdef"  # the gate's fingerprint the file belongs to


@pytest.fixture(scope="module")
def recorded(stores):
    from poros.engine.parity import RecordedReference
    from poros.engine.trainer import ResidentTrainer

    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, grad_accum=2, lr=1e-2)
    return cfg, RecordedReference(ResidentTrainer(stores("tiny-qwen3"), cfg), 2)


def _gate(stores, cfg, reference, **change):
    from poros.engine.executor import PorosTrainer
    from poros.engine.parity import run_gate_recorded

    return run_gate_recorded(reference, PorosTrainer(stores("tiny-qwen3"), cfg.replace(**change)))


def test_a_gate_against_saved_digests_passes_where_the_recorded_states_do(stores, recorded, tmp_path):
    cfg, reference = recorded
    path = tmp_path / "ref.json.gz"
    checksum = DigestReference.of(reference).save(path, FP)
    kept = DigestReference.load(path, FP, checksum)
    assert path.stat().st_size < 200_000 and not list(tmp_path.glob("*.part"))
    full, digests = _gate(stores, cfg, reference, block_size=1), _gate(stores, cfg, kept, block_size=1)
    assert full.ok and digests.ok, (full.first_mismatch, digests.first_mismatch)
    assert digests.tensors_compared == full.tensors_compared and digests.steps == 2
    assert digests.losses == full.losses and digests.gate == "resident (recorded)"


def test_a_gate_against_digests_fails_naming_the_tensor(stores, recorded, tmp_path):
    """Negative controls: other arithmetic (lr) FAILs at the first weight it changes, as against the recorded states;
    one digest changed in the file FAILs at that tensor."""
    cfg, reference = recorded
    kept = DigestReference.of(reference)
    other = _gate(stores, cfg, kept, lr=2e-2)
    assert other.parity == "FAIL" and other.first_mismatch == _gate(stores, cfg, reference, lr=2e-2).first_mismatch
    assert other.first_mismatch.startswith("step0.weight:") and other.max_abs_diff == float("inf")

    changed = DigestReference.of(reference)
    name = sorted(changed.states[1].adamw)[3]
    changed.states[1].adamw[name] = type(changed.states[1].adamw[name])("0" * 32)
    tampered = _gate(stores, cfg, changed)
    assert tampered.parity == "FAIL" and tampered.first_mismatch == f"step1.adamw:{name}", tampered.first_mismatch


def _edit(path, change) -> None:
    doc = json.loads(gzip.open(path, "rt").read())
    change(doc)
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)


def _flip_digit(doc) -> None:
    name = sorted(doc["states"][1]["adamw"])[3]
    h = doc["states"][1]["adamw"][name]
    doc["states"][1]["adamw"][name] = ("1" if h[0] == "0" else "0") + h[1:]


def _edit_loss(doc) -> None:
    doc["states"][0]["losses"][0][1] += 1.0


@pytest.mark.parametrize("change, why", [(_flip_digit, "do not match its checksum"),
                                         (_edit_loss, "do not match its checksum")],
                         ids=["one-hex-digit", "stored-loss"])
def test_a_digest_file_edited_by_hand_is_refused_by_name(recorded, tmp_path, change, why):
    """A file whose digests or losses were changed is refused naming it (the suites record the reference again),
    never compared and blamed on the gated method as a parity FAIL."""
    _, reference = recorded
    path = tmp_path / "ref.json.gz"
    checksum = DigestReference.of(reference).save(path, FP)
    assert DigestReference.load(path, FP, checksum).states  # negative control: the file as written loads
    _edit(path, change)
    with pytest.raises(DigestsRefused) as e:
        DigestReference.load(path, FP, checksum)
    assert str(e.value).startswith(f"{path}: ") and why in str(e.value) and "\n" not in str(e.value)


def test_another_gates_digests_are_refused(recorded, tmp_path):
    """Another gate's file copied over this one (its own fingerprint), or another run's file of the same gate (not
    the checksum this run's pass log recorded): refused by name."""
    _, reference = recorded
    mine, theirs = tmp_path / "mine.json.gz", tmp_path / "theirs.json.gz"
    checksum = DigestReference.of(reference).save(mine, FP)
    DigestReference.of(reference).save(theirs, "fedcba9876543210")
    with pytest.raises(DigestsRefused, match="another gate .*fingerprint fedcba9876543210.*another run's file"):
        DigestReference.load(theirs, FP)
    with pytest.raises(DigestsRefused, match="not the file this run recorded"):
        DigestReference.load(mine, FP, "f" * 64)
    assert DigestReference.load(mine, FP, checksum).method == DigestReference.load(theirs, "fedcba9876543210").method


def test_a_digest_sees_one_bit_dtype_and_shape():
    t = torch.randn(4, 6, dtype=torch.bfloat16)
    same = t.clone()
    assert tensor_digest(t) == tensor_digest(same) == tensor_digest(t.t().contiguous().t())
    flipped = t.clone()
    flipped.view(torch.int16)[2, 3] ^= 1
    assert tensor_digest(flipped) != tensor_digest(t)
    assert tensor_digest(t.view(torch.int16)) != tensor_digest(t)  # same bytes, another dtype
    assert tensor_digest(t.reshape(6, 4)) != tensor_digest(t)  # same bytes, another shape
    assert tensor_digest(torch.tensor(1.5)) != tensor_digest(torch.tensor([1.5]))


def test_a_cut_or_foreign_file_is_refused_by_name(tmp_path):
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(gzip.compress(b'{"format": 2, "method": "resident", "init": {'))
    with pytest.raises(PorosError, match="cut.json.gz: not a gate reference's digests"):
        DigestReference.load(cut, FP)
    other = tmp_path / "other.json.gz"
    other.write_bytes(gzip.compress(b'{"format": 99}'))
    with pytest.raises(PorosError, match="format 99"):
        DigestReference.load(other, FP)
    earlier = tmp_path / "earlier.json.gz"  # a file of the format before checksums
    earlier.write_bytes(gzip.compress(b'{"format": 1, "method": "resident", "init": {}, "states": []}'))
    with pytest.raises(DigestsRefused, match="format 1, expected 2"):
        DigestReference.load(earlier, FP)
