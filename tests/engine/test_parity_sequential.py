"""A gate whose method holds the allocator to a budget runs its reference first and alone (recorded in host
memory): the cap is process-wide, so a reference alive beside the method would count against it."""

from __future__ import annotations

from types import SimpleNamespace

from poros.config import Method, TrainConfig
from poros.engine.verify import parity as G


def test_which_runs_hold_a_cap():
    cuda = TrainConfig(model="tiny-qwen2", device="cuda", vram_budget="24GB")
    assert G.holds_a_cap(cuda, Method.POROS)
    assert not G.holds_a_cap(cuda, Method.RESIDENT)  # the reference never plans a budget
    assert not G.holds_a_cap(cuda.replace(vram_budget=None), Method.POROS)
    assert not G.holds_a_cap(TrainConfig(model="tiny-qwen2", device="cpu", vram_budget="5MB"), Method.POROS)


def gate_events(monkeypatch, cfg: TrainConfig, **kw) -> list[str]:
    events = []

    class Fake:
        def __init__(self, method):
            self.method = method.value
            events.append(f"make {self.method}")

        def close(self):
            events.append(f"close {self.method}")

    monkeypatch.setattr(G, "make_trainer", lambda method, store, cfg, world: Fake(method))
    monkeypatch.setattr(G, "RecordedReference", lambda trainer, steps: events.append("record") or "recorded")
    monkeypatch.setattr(G, "run_gate_recorded", lambda rec, mine, steps: events.append("gate recorded")
                        or SimpleNamespace(gate=None))
    monkeypatch.setattr(G, "run_gate", lambda ref, mine, steps, **k: events.append("gate together"))
    monkeypatch.setattr(G, "agree", lambda result, world: result)
    G.parity(cfg, steps=1, store=object(), **kw)
    return events


def test_a_capped_method_is_gated_against_a_reference_recorded_and_closed_first(monkeypatch):
    cfg = TrainConfig(model="tiny-qwen2", device="cuda", vram_budget="24GB")
    assert gate_events(monkeypatch, cfg) == ["make resident", "record", "close resident", "make poros",
                                             "gate recorded"]
    # negative control: without a budget the two run side by side, as before
    assert gate_events(monkeypatch, cfg.replace(vram_budget=None)) == ["make resident", "make poros",
                                                                        "gate together"]
