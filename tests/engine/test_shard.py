"""The shared stream (shard_stream): each data-parallel rank copies its share of every streamed block and an
all-gather completes it. The plan's gathers and their rules (each broken), the shares' bytes, `poros plan
--gpus N --shard-stream`, and two ranks under torchrun (gloo) against resident DDP with a negative control;
on two GPUs (NCCL) the same checks.

    pytest -m gpu tests/engine/test_shard.py    # the GPU tier
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poros.cli import main
from poros.config import TrainConfig
from poros.engine.planning import plan as P
from poros.engine.planning.geometry import Geometry
from poros.engine.planning.rules import check
from poros.engine.planning.search import PlanRequest, build_plan
from poros.errors import CapabilityError, ConfigError
from poros.models.checkpoint import resolve
from poros.choices import Accumulation
from poros.settings import LORA_TARGETS
from poros.store.layout import ALIGN
from tests.capabilities import requires_gpu
from tests.engine.test_distributed import launch
from tests.plans import plan_request


def geometry(model: str) -> Geometry:
    return Geometry.of_config(model, resolve(model).config, LORA_TARGETS)


@pytest.fixture(scope="module")
def tiny():
    return geometry("tiny-qwen2")


TINY_PLAN = build_plan(geometry("tiny-qwen2"), plan_request(block_size=1))


def shared(geo, shards: int, **kw) -> P.Plan:
    return build_plan(geo, plan_request(block_size=kw.pop("block_size", 1), shards=shards, **kw))


# --- the plan ------------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(shards=st.integers(2, 4), resident=st.integers(0, 5), block=st.integers(1, 3), accum=st.integers(1, 3),
       order=st.sampled_from(list(Accumulation)), head=st.sampled_from([None, True]))
def test_every_shared_plan_gathers_each_streamed_load_and_keeps_the_rules(shards, resident, block, accum, order,
                                                                          head):
    geo = geometry("tiny-gemma3")
    plan = build_plan(geo, plan_request(block_size=block, grad_accum=accum, accumulation=order,
                                           resident_layers=resident, head_resident=head, shards=shards))
    assert check(plan) == [] and plan.shards == shards
    for ops in (plan.setup, plan.step):
        for op, nxt in zip(ops, (*ops[1:], None)):
            streamed = op.kind == P.LOAD_HEAD or op.kind == P.LOAD and not plan.groups[op.group].resident
            follows = nxt is not None and nxt.kind in (P.GATHER, P.GATHER_HEAD) and nxt.buffer == op.buffer
            assert follows == streamed, (op, nxt)  # every streamed load, and nothing else, gathered at once
    alone = replace(plan, shards=1)
    # the ranks' shares add up to every byte each rank would copy alone; each rank gathers the others'
    assert sum(sum(plan.op_bytes(op, r) for op in plan.step) for r in range(shards)) == alone.h2d_bytes_per_step
    gathers = [op for op in plan.step if op.kind in (P.GATHER, P.GATHER_HEAD)]
    assert plan.gathered_bytes_per_step == sum((shards - 1) * plan.shard_size(plan._op_nbytes(op)) for op in gathers)
    unshared = build_plan(geo, plan_request(block_size=block, grad_accum=accum, accumulation=order,
                                               resident_layers=resident, head_resident=head))
    assert [op for op in plan.step if op.kind not in (P.GATHER, P.GATHER_HEAD)] == list(unshared.step)
    # the stream buffers hold every group's padded shares (the gather runs in place over them)
    size = next((b.nbytes for b in plan.buffers if not b.resident), 0)
    assert all(plan.gathered_size(g.nbytes) <= size for g in plan.groups if not g.resident)
    if plan.head_buffer is not None:
        assert plan.gathered_size(plan.head_bytes) <= size + plan.head_pad


@settings(deadline=None)
@given(nbytes=st.integers(1, 10**7), shards=st.integers(2, 8))
def test_shares_are_equal_aligned_and_cover_the_copy(nbytes, shards):
    plan = replace(TINY_PLAN, shards=shards)
    s = plan.shard_size(nbytes)
    assert s % ALIGN == 0 and shards * s >= nbytes > (shards - 1) * s - shards * ALIGN
    ranges = [plan.shard(nbytes, r) for r in range(shards)]
    assert ranges[0][0] == 0 and ranges[-1][1] == nbytes
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and all(hi - lo <= s for lo, hi in ranges)


def test_72b_each_of_two_ranks_copies_half_and_gathers_half():
    q72 = geometry("qwen2.5-72b")
    one, two = build_plan(q72, plan_request(block_size=4)), build_plan(q72, plan_request(block_size=4, shards=2))
    assert abs(two.h2d_bytes_per_step - one.h2d_bytes_per_step / 2) < two.loads_per_step * 2 * ALIGN
    assert abs(two.gathered_bytes_per_step - one.h2d_bytes_per_step / 2) < two.loads_per_step * 2 * ALIGN
    # the gather needs no receive buffer of its own: the peak grows by the shares' padding alone
    assert 0 <= two.memory.total - one.memory.total <= 4 * ALIGN
    assert two.summary()["shards"] == 2 and two.summary()["gathered_bytes_per_step"] == two.gathered_bytes_per_step


# --- each gather rule, broken --------------------------------------------------------------------

def _first(plan, kind, after: int = 0) -> int:
    return next(i for i, op in enumerate(plan.step) if op.kind == kind and i >= after)


def test_rule_no_read_before_the_gather(tiny):
    plan = shared(tiny, 2)
    pos = _first(plan, P.GATHER)
    problems = check(replace(plan, step=plan.step[:pos] + plan.step[pos + 1:]))  # the gather dropped
    assert any("before its gather" in p for p in problems), problems
    problems = check(replace(plan, setup=tuple(op for op in plan.setup if op.kind != P.GATHER)))
    assert any("before its gather" in p for p in problems), problems  # setup's gathers dropped
    pos = _first(plan, P.GATHER_HEAD)
    problems = check(replace(plan, step=plan.step[:pos] + plan.step[pos + 1:]))
    assert any("lm_head before its gather" in p for p in problems), problems


def test_rule_no_gather_into_a_buffer_before_the_release_after_its_last_read(tiny):
    """A gather writes the buffer as a load does: one after a read of the group it holds, with no release
    between, would overwrite bytes a pending backward still reads."""
    plan = shared(tiny, 2)
    ops = list(plan.step)
    pos = _first(plan, P.FORWARD, after=_first(plan, P.GATHER))
    read = ops[pos]
    gather = P.Op(P.GATHER, group=read.group, buffer=plan.groups[read.group].buffer)
    problems = check(replace(plan, step=tuple(ops[:pos + 1] + [gather] + ops[pos + 1:])))
    assert any("gathers into buffer" in p and "before the release" in p for p in problems), problems


def test_rule_a_gather_fills_the_group_its_buffer_holds(tiny):
    plan = shared(tiny, 2)
    ops = list(plan.step)
    pos = _first(plan, P.GATHER)
    ops[pos] = replace(ops[pos], group=(ops[pos].group + 1) % len(plan.groups))
    problems = check(replace(plan, step=tuple(ops)))
    assert any("which holds" in p for p in problems), problems


def test_rule_a_gather_needs_shares(tiny):
    plan = shared(tiny, 2)
    problems = check(replace(plan, shards=1))
    assert any("not shared among ranks" in p for p in problems), problems
    problems = check(replace(plan, step=plan.step + (plan.step[_first(plan, P.GATHER)],)))
    assert any("no share of a load" in p or "which holds" in p for p in problems), problems


def test_an_unsafe_shared_plan_is_refused_by_the_executor(stores, tiny):
    from poros.engine.executor import PorosTrainer

    plan = shared(geometry("tiny-qwen3"), 2, block_size=2)
    pos = _first(plan, P.GATHER)
    broken = replace(plan, step=plan.step[:pos] + plan.step[pos + 1:])
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, block_size=2)
    with pytest.raises(CapabilityError, match="before its gather"):
        PorosTrainer(stores("tiny-qwen3"), cfg, plan=broken)
    with pytest.raises(CapabilityError, match="shares its copies among 2 ranks but 1 run it"):
        PorosTrainer(stores("tiny-qwen3"), cfg, plan=plan)


# --- settings and the command line ---------------------------------------------------------------

def test_shard_stream_needs_ranks():
    with pytest.raises(ConfigError, match="shard_stream: .* needs gpus > 1; got gpus=1"):
        TrainConfig(model="tiny-qwen3", shard_stream=True)
    cfg = TrainConfig(model="tiny-qwen3", shard_stream=True, gpus=2)
    assert PlanRequest.of_config(cfg).shards == 2 and PlanRequest.of_config(cfg, ranks=1).shards == 1
    assert PlanRequest.of_config(cfg.replace(shard_stream=False)).shards == 1


def test_plan_command_predicts_each_ranks_bytes_and_peak(capsys):
    assert main(["plan", "--model", "qwen2.5-72b", "--gpus", "2", "--shard-stream", "--json"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert main(["plan", "--model", "qwen2.5-72b", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert two["shards"] == 2 and one["shards"] == 1 and one["gathered_bytes_per_step"] == 0
    assert two["h2d_bytes_per_step"] + two["gathered_bytes_per_step"] >= one["h2d_bytes_per_step"]
    assert two["h2d_bytes_per_step"] < 0.51 * one["h2d_bytes_per_step"]
    assert one["peak_vram_bytes"] <= two["peak_vram_bytes"] < one["peak_vram_bytes"] + 10**6
    assert main(["plan", "--model", "qwen2.5-72b", "--gpus", "2", "--shard-stream"]) == 0
    text = capsys.readouterr().out
    assert "shared stream over 2 ranks" in text and "all-gathers 37.7" in text


# --- two ranks (gloo): exact against resident DDP -------------------------------------------------

@pytest.fixture(scope="module")
def shard_ranks(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("shard") / "ranks.json", "tiny-qwen3", "cpu", mode="shard")


def check_shared_stream(report: dict) -> None:
    """What two ranks sharing the stream must show on any device."""
    test_shared_stream_matches_resident_ddp_on_every_rank(report)
    test_a_stale_share_fails_the_gate(report)
    test_each_rank_copies_its_share_and_gathers_the_rest(report)


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_shared_stream_matches_resident_ddp_on_every_rank(shard_ranks):
    assert shard_ranks["world_size"] == 2
    for name in ("gate", "micro", "budget"):  # layer-major, micro-batch-major, some layers resident
        gate = shard_ranks[name]
        assert gate["parity"] == "PASS" and gate["ranks"] == ["PASS", "PASS"], (name, gate["first_mismatch"])
        assert gate["world_size"] == 2 and gate["tensors_compared"] > 900
    assert shard_ranks["gate"]["steps"] == 2 and 0 < shard_ranks["budget"]["resident_layers"] < 5
    plan = shard_ranks["plan"]
    assert plan["shards"] == 2 and not plan["head_resident"]  # the lm_head's share is gathered as well
    assert shard_ranks["gathers"] == plan["loads_per_step"] + 1


@pytest.mark.slow  # two gloo ranks under torchrun (the module's ranks)
def test_a_stale_share_fails_the_gate(shard_ranks):
    """Negative control: the collective runs, but the other rank's share of one group never reaches the
    buffer (it keeps the bytes of the group before)."""
    control = shard_ranks["control"]
    assert control["parity"] == "FAIL" and control["ranks"] == ["FAIL", "FAIL"], control
    assert control["first_mismatch"].startswith("rank 0: step0.")


@pytest.mark.slow  # two gloo ranks under torchrun (the module's ranks)
def test_each_rank_copies_its_share_and_gathers_the_rest(shard_ranks):
    plan, counters = shard_ranks["plan"], shard_ranks["counters"]
    for rank, c in enumerate(counters):
        assert c["shared"]["bytes_h2d"] == c["h2d_planned"], rank  # each rank its own share, as planned
        assert c["shared"]["bytes_gathered"] == plan["gathered_bytes_per_step"], rank
        # alone: the same plan, every byte over its own link and no gather
        assert c["alone"]["bytes_h2d"] == shard_ranks["unshared_h2d"] and c["alone"]["bytes_gathered"] == 0
    assert counters[0]["h2d_planned"] == plan["h2d_bytes_per_step"]
    assert sum(c["shared"]["bytes_h2d"] for c in counters) == shard_ranks["unshared_h2d"]


@pytest.mark.gpu
@requires_gpu(2)
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-gemma3"])
def test_gpu_shared_stream(model, tmp_path):
    """The same on two GPUs: NCCL's all-gather in place on the gather stream, behind the copy's event."""
    report = launch(tmp_path / "ranks.json", model, "cuda", mode="shard")
    print(report["gate"])
    check_shared_stream(report)


@pytest.mark.slow  # a matrix suite under torchrun: minutes on two cores
@pytest.mark.extended  # ranks in a matrix run in CI (tests/suites/test_matrix_runs.py), the shared stream's gate above
def test_a_shared_stream_matrix_row_records_its_bytes_and_scaling(tmp_path):
    """`gpus: 2, shard_stream: true` on the CPU (gloo): the poros row carries each rank's bytes from the host and
    from its peer, and `scaling` over rank 0's one-device figure timed in the same run."""
    from tests.suite_runs import TINY, run_suite, why

    matrix = {**TINY, "steps": 1, "passes": 1, "warmup_passes": 0, "grad_accum": 2, "gpus": 2, "parity_steps": 1,
              "shard_stream": True, "methods": ["poros", "resident"], "models": ["tiny-qwen3"]}
    proc, results = run_suite(tmp_path, matrix)
    assert proc.returncode == 0, why(proc)
    rows = {r["method"]: r for r in map(json.loads, results.read_text().splitlines())}
    poros, resident = rows["poros"], rows["resident"]
    assert poros["parity"] == "PASS" and poros["world_size"] == 2 and poros["shard_stream"] is True
    assert poros["plan"]["shards"] == 2
    assert poros["h2d_bytes_per_rank"] == poros["plan"]["h2d_bytes_per_step"] > 0
    assert poros["gathered_bytes_per_rank"] == poros["plan"]["gathered_bytes_per_step"] > 0
    alone_tokens = 64 * 2 / poros["alone_s_per_step_median"]  # one device's step: seq x grad_accum
    assert abs(poros["scaling"] - poros["tokens_per_s"] / alone_tokens) < 1e-9 * poros["scaling"]
    assert "scaling" not in resident and "gathered_bytes_per_rank" not in resident
