"""The streaming engine's schedule: block plan, bounded residency, and bytes copied per step."""

from __future__ import annotations

import pytest

from poros.build import build_store
from poros.config import TrainConfig
from poros.residency import PorosTrainer
from poros.streaming import N_BUFFERS, plan_blocks


@pytest.fixture(scope="module")
def store():
    return build_store("tiny-gemma3", seed=0, device="cpu", progress=False)[0]


@pytest.mark.parametrize("block", [1, 2, 3, 5, 8], ids=lambda k: f"block={k}")
def test_blocks_cover_layers_contiguously(store, block):
    blocks = plan_blocks(store, block)
    assert [b.first for b in blocks] == list(range(0, len(store.layers), block))
    assert blocks[-1].stop == len(store.layers)
    for a, b in zip(blocks, blocks[1:]):
        assert a.stop == b.first and a.end == b.start  # one contiguous copy per block
    assert sum(b.nbytes for b in blocks) == store.nbytes


def expected_copies(n_blocks: int, steps: int) -> int:
    """Block copies for `steps` steps. Forward loads 0..B-1 except the two the previous backward
    left resident (first step: all). The lm_head borrows B-2's buffer, so backward reloads B-2
    and loads B-3..0; only B-1 stays resident across the turn."""
    if steps == 0:
        return 0
    if n_blocks == 1:
        return 1
    first = n_blocks + (n_blocks - 1)
    later = (n_blocks - N_BUFFERS) + (n_blocks - 1)
    return first + later * (steps - 1)


@pytest.mark.parametrize("block", [1, 2, 5], ids=lambda k: f"block={k}")
def test_counters_match_the_schedule(store, block):
    trainer = PorosTrainer(store, TrainConfig(model="tiny-gemma3", seq_len=64, block_size=block))
    blocks = plan_blocks(store, block)
    total = 0
    for step in range(3):
        r = trainer.step()
        c = r.counters
        assert c["peak_blocks_resident"] <= N_BUFFERS
        copies = expected_copies(len(blocks), step + 1) - expected_copies(len(blocks), step) if step else expected_copies(len(blocks), 1)
        assert c["block_copies"] == copies
        total += c["block_copies"]
        # every block copied is whole, plus the lm_head once per micro-batch
        assert c["bytes_h2d"] >= trainer.head_bytes
        block_bytes = c["bytes_h2d"] - trainer.head_bytes
        assert block_bytes <= copies * max(b.nbytes for b in blocks)
        assert block_bytes >= copies * min(b.nbytes for b in blocks)
    assert total == expected_copies(len(blocks), 3)


def test_weight_buffers_are_allocated_once(store):
    trainer = PorosTrainer(store, TrainConfig(model="tiny-gemma3", seq_len=64, block_size=2))
    ptrs = [b.data_ptr() for b in trainer.streamer.buffers]
    trainer.step()
    trainer.step()
    assert [b.data_ptr() for b in trainer.streamer.buffers] == ptrs
    assert len(ptrs) == N_BUFFERS
    # every Linear4bit reads from a view of one of the two buffers
    lo = min(ptrs)
    hi = max(ptrs) + trainer.streamer.buffers[0].numel()
    for q in trainer.qlora.linear4bit.values():
        assert lo <= q.weight.data_ptr() < hi


@pytest.mark.parametrize("model", ["tiny-qwen2", "tiny-gemma3"], ids=["untied", "tied"])
def test_the_lm_head_is_found_in_the_store_tied_or_not(model):
    """The entry pinned for the lm_head copy: tied models store only the embedding (regression:
    looking up `lm_head.weight` in the store raised KeyError for Gemma on CUDA)."""
    store, _ = build_store(model)
    poros = PorosTrainer(store, TrainConfig(model=model, seq_len=64, block_size=2))
    name = poros._head_store_name()
    assert name is not None and store.dense[name].data_ptr() == poros._head_host.data_ptr()
    tied = bool(getattr(store.config, "tie_word_embeddings", False))
    assert ("embed_tokens" in name) == tied, (name, tied)
    poros.close()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_layer_backward_runs_where_the_schedule_says(store, overlap):
    """With `overlap_backward` every layer's backward runs on the worker thread (so the next
    layer's recompute can be enqueued meanwhile); without it, on the calling thread."""
    import threading

    trainer = PorosTrainer(store, TrainConfig(model="tiny-gemma3", seq_len=64, block_size=2,
                                              overlap_backward=overlap))
    seen: dict[int, set[str]] = {}
    for i, layer in enumerate(trainer.qlora.layers):
        p = next(p for n, p in layer.named_parameters() if "lora_A" in n)
        p.register_hook(lambda g, i=i: seen.setdefault(i, set()).add(threading.current_thread().name))
    trainer.step()
    assert sorted(seen) == list(range(len(trainer.qlora.layers)))
    names = set().union(*seen.values())
    if overlap:
        assert all(n.startswith("poros-backward") for n in names), names
    else:
        assert names == {threading.current_thread().name}
    trainer.close()
    assert trainer._worker is None


def test_an_error_in_a_worker_backward_reaches_the_caller(store, monkeypatch):
    """The overlapped backward must not swallow failures: an exception raised by a layer's backward
    on the worker thread surfaces from the step, and the trainer still closes cleanly."""
    import threading

    import poros.residency as r

    trainer = PorosTrainer(store, TrainConfig(model="tiny-gemma3", seq_len=64, block_size=2))
    real = r.torch.autograd.backward

    def backward(tensors, grad_tensors=None, *a, **k):
        if threading.current_thread().name.startswith("poros-backward"):
            raise RuntimeError("injected backward failure")
        return real(tensors, grad_tensors, *a, **k)

    monkeypatch.setattr(r.torch.autograd, "backward", backward)
    with pytest.raises(RuntimeError, match="injected backward failure"):
        trainer.step()
    trainer.close()
