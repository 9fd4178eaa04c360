"""Data parallelism on the CPU (gloo): two ranks under torchrun, poros against resident QLoRA under
DistributedDataParallel, with a negative control; the ranks of a host share one store; four, three and two ranks
of one launch, each rank count gated, with a negative control that adds the ranks in another order."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from poros.engine.distributed import SINGLE, GradReducer, World, init_world, ordered_sum
from poros.errors import CapabilityError, PorosError
from poros.harness.ranks import launch_env, torchrun

WORKER = Path(__file__).resolve().parents[1] / "distributed_worker.py"


def launch(out: Path, model: str, device: str, nproc: int = 2, mode: str = "") -> dict:
    """Run tests/distributed_worker.py under torchrun (`mode` "shard": the shared stream's checks); rank 0's
    report."""
    cmd = torchrun(nproc) + [str(WORKER), str(out), model, device] + ([mode] if mode else [])
    proc = subprocess.run(cmd, env=launch_env(nproc), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("ddp") / "ranks.json", "tiny-qwen3", "cpu")


def check_two_ranks(report: dict) -> None:
    """What two ranks must show on any device: the gate PASSes on both, the control FAILs on both, one
    shared store, each rank its own data."""
    test_poros_matches_resident_ddp_on_every_rank(report)
    test_ranks_train_on_their_own_share(report)
    test_unreduced_layer_fails_the_gate(report)
    test_one_store_per_host(report)


@pytest.mark.slow  # two gloo ranks under torchrun
def test_poros_matches_resident_ddp_on_every_rank(two_ranks):
    gate = two_ranks["gate"]
    assert two_ranks["world_size"] == 2 and gate["world_size"] == 2
    assert gate["parity"] == "PASS" and gate["ranks"] == ["PASS", "PASS"], gate["first_mismatch"]
    assert gate["steps"] == 2 and gate["tensors_compared"] > 1000
    micro = two_ranks["micro"]  # the micro-batch-major order reduces each layer after the last micro-batch too
    assert micro["accumulation"] == "micro" and micro["parity"] == "PASS" and micro["ranks"] == ["PASS", "PASS"]
    budget = two_ranks["budget"]  # some layers resident, the rest streamed, layer-major
    assert budget["parity"] == "PASS" and budget["ranks"] == ["PASS", "PASS"], budget["first_mismatch"]
    assert 0 < budget["resident_layers"] < 5


@pytest.mark.slow  # two gloo ranks under torchrun
def test_ranks_train_on_their_own_share(two_ranks):
    rank0, rank1 = two_ranks["losses"]
    assert len(rank0) == len(rank1) == 4 and rank0 != rank1


@pytest.mark.slow  # two gloo ranks under torchrun
def test_unreduced_layer_fails_the_gate(two_ranks):
    control = two_ranks["control"]
    assert control["parity"] == "FAIL" and control["ranks"] == ["FAIL", "FAIL"]
    assert "layers.0." in control["first_mismatch"] and ".grad:" in control["first_mismatch"]


@pytest.mark.slow  # two gloo ranks under torchrun
def test_one_store_per_host(two_ranks):
    assert two_ranks["arena_shared"] and two_ranks["dense_shared"]  # both ranks map the memfd
    assert two_ranks["checksums_equal"]


@pytest.fixture(scope="module")
def four_to_two_ranks(tmp_path_factory):
    """One launch of four ranks that goes on as three, then two (tests/distributed_worker.py `order`)."""
    return launch(tmp_path_factory.mktemp("order") / "ranks.json", "tiny-qwen2", "cpu", nproc=4, mode="order")


@pytest.mark.slow  # one launch of four gloo ranks under torchrun, gated at four, three and two
@pytest.mark.parametrize("ranks", [2, 3, 4], ids=lambda n: f"ranks={n}")
def test_poros_matches_resident_at_any_number_of_ranks(four_to_two_ranks, ranks):
    """poros and resident_gc_offload equal resident under DDP, on every rank, from three ranks on too (where an
    all-reduce's order of additions depends on how the gradients are grouped)."""
    world = four_to_two_ranks["worlds"][str(ranks)]
    for side in ("gate", "offload"):
        gate = world[side]
        assert gate["world_size"] == ranks and gate["ranks"] == ["PASS"] * ranks, (side, gate["first_mismatch"])
        assert gate["parity"] == "PASS" and gate["steps"] == 1
        assert gate["tensors_compared"] > 400 * ranks  # every rank's, summed
    assert world["offload"]["method"] == "resident_gc_offload"


@pytest.mark.slow  # one launch of four gloo ranks under torchrun
@pytest.mark.parametrize("ranks", [3, 4], ids=lambda n: f"ranks={n}")
def test_ranks_added_in_another_order_fail_the_gate(four_to_two_ranks, ranks):
    """Negative control: poros's reducer adding the ranks last to first gives other bits from three ranks on."""
    control = four_to_two_ranks["worlds"][str(ranks)]["control"]
    assert control["parity"] == "FAIL" and control["ranks"] == ["FAIL"] * ranks
    assert ".grad:" in control["first_mismatch"] and "lora_" in control["first_mismatch"]


@pytest.mark.slow  # one launch of four gloo ranks under torchrun
def test_two_ranks_add_in_either_order_alike(four_to_two_ranks):
    """With two ranks each element is one addition, and a + b == b + a: the control's order changes nothing,
    which is why two ranks matched before the reduction had an order at all."""
    assert four_to_two_ranks["worlds"]["2"]["control"]["parity"] == "PASS"


def ring_sum(parts):
    """A ring all-reduce's sums, as gloo's and NCCL's rings add: the buffer split into one chunk a rank, chunk c
    added from rank c onwards (c, c + 1, ..., c - 1 modulo the ranks)."""
    import torch

    n, length = parts.shape
    size = -(-length // n)
    out = torch.empty(length, dtype=parts.dtype)
    for c in range(n):
        span = slice(c * size, min((c + 1) * size, length))
        out[span] = ordered_sum(parts[:, span], tuple((c + k) % n for k in range(n)))
    return out


def test_ordered_sum_does_not_depend_on_how_gradients_are_grouped():
    """Two gradients reduced in one bucket or each in its own: `ordered_sum` gives the same bits either way. Negative
    control: a ring's sums differ, since the second gradient's elements fall in other chunks of the bucket."""
    import torch

    ranks, gen = 3, torch.Generator().manual_seed(0)
    a, b = (torch.randn(ranks, n, generator=gen) * 10.0 ** torch.randint(-4, 4, (ranks, n), generator=gen)
            for n in (50, 70))
    bucket = torch.cat([a, b], dim=1)
    assert torch.equal(ordered_sum(bucket)[50:], ordered_sum(b))
    assert torch.equal(ordered_sum(bucket)[:50], ordered_sum(a))
    assert not torch.equal(ring_sum(bucket)[50:], ring_sum(b))


def test_ordered_sum_adds_in_the_order_given():
    import torch

    parts = torch.tensor([[1.0], [1e8], [-1e8]])  # 1 + 1e8 rounds to 1e8 in float32
    assert ordered_sum(parts).item() == 0.0  # (1 + 1e8) - 1e8
    assert ordered_sum(parts, (2, 1, 0)).item() == 1.0  # (-1e8 + 1e8) + 1
    assert ordered_sum(parts[:2], (1, 0)).item() == ordered_sum(parts[:2]).item()  # two ranks: either order


def test_reducer_keeps_fewer_gathers_in_flight_at_more_ranks():
    """A layer's gather holds every rank's gradient: the layers in flight shrink as ranks grow, so that their
    bytes stay what two ranks' would hold."""
    from poros.engine.distributed import IN_FLIGHT

    in_flight = {n: GradReducer([], World(0, n, 0, n)).in_flight for n in (2, 3, 4, 8, 64)}
    assert in_flight == {2: IN_FLIGHT, 3: IN_FLIGHT * 2 // 3, 4: IN_FLIGHT // 2, 8: 1, 64: 1}


def test_share_splits_a_step_by_rank():
    items = list(range(6))
    assert [World(r, 3, r, 3).share(items) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert SINGLE.share(items) == items
    with pytest.raises(CapabilityError, match="do not split over 4 ranks"):
        World(0, 4, 0, 4).share(items)


def test_launch_without_rendezvous_is_one_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(PorosError, match="torchrun --nproc-per-node"):
        init_world("cpu")


def test_reducer_refuses_a_layer_twice():
    import torch

    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    r = GradReducer([[p]], World(0, 2, 0, 2), skip=frozenset({0}))
    r.layer_done(0)
    with pytest.raises(CapabilityError, match="reduced twice"):
        r.layer_done(0)
    r.finish()
    with pytest.raises(CapabilityError, match="without their gradients reduced"):
        r.finish()


def test_alone_trains_by_itself_and_gives_back_its_collectives(stores):
    """`Trainer.alone()`: inside, this rank's own micro-batches and no reducer; after, the world and the
    reducer it had (also when the block raises)."""
    from poros.config import TrainConfig
    from poros.engine.executor import PorosTrainer

    trainer = PorosTrainer(stores("tiny-qwen3"), TrainConfig(model="tiny-qwen3", seq_len=64, grad_accum=2))
    world, reducer = World(1, 2, 1, 2), object()
    trainer.world, trainer.reducer = world, reducer  # as a data-parallel rank holds them
    import torch

    share = trainer.batches(0)  # rank 1's share of the step's 2 x 2 micro-batches: the last two
    with trainer.alone():
        assert trainer.world is SINGLE and trainer.reducer is None
        own = trainer.batches(0)  # a step of its own: 2 micro-batches, the step's first two
        assert len(share) == len(own) == 2 and not torch.equal(share[0].input_ids, own[0].input_ids)
        assert trainer.step().loss > 0  # no collective to wait on
    assert trainer.world is world and trainer.reducer is reducer
    with pytest.raises(RuntimeError), trainer.alone():
        raise RuntimeError("a step failed")
    assert trainer.world is world and trainer.reducer is reducer
    trainer.close()
