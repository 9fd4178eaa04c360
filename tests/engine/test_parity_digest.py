"""The gate against a reference kept as digests (poros/engine/parity_digest.py), as a run in parts uses it: saved
and loaded again, it PASSes where the reference's recorded states do and FAILs where they do, naming the tensor."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from poros.config import TrainConfig
from poros.engine.parity_digest import DigestReference, tensor_digest
from poros.errors import PorosError


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
    DigestReference.of(reference).save(path)
    kept = DigestReference.load(path)
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

    path = tmp_path / "ref.json.gz"
    kept.save(path)
    doc = json.loads(gzip.open(path, "rt").read())
    name = sorted(doc["states"][1]["adamw"])[3]
    doc["states"][1]["adamw"][name] = "0" * 32
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    tampered = _gate(stores, cfg, DigestReference.load(path))
    assert tampered.parity == "FAIL" and tampered.first_mismatch == f"step1.adamw:{name}", tampered.first_mismatch


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
    cut.write_bytes(gzip.compress(b'{"format": 1, "method": "resident", "init": {'))
    with pytest.raises(PorosError, match="cut.json.gz: not a gate reference's digests"):
        DigestReference.load(cut)
    other = tmp_path / "other.json.gz"
    other.write_bytes(gzip.compress(b'{"format": 99}'))
    with pytest.raises(PorosError, match="format 99"):
        DigestReference.load(other)
