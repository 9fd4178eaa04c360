"""The Unsloth parent process on CPU, with a stand-in child: what it logs, and that a result
survives a cut-off during the export's clean-up (the H200 run that lost gemma4's row)."""

from __future__ import annotations

import io
import json

import pytest

import poros.harness.unsloth as um
from poros.config import TrainConfig
from poros.errors import CapabilityError

RECORD = {"per_pass_s": [2.0, 2.1], "s_per_step_median": 0.41, "peak_vram_gb": 21.5, "peak_vram_nvml_gb": 23.0,
          "linear4bit_modules": 7, "unsloth_version": "test"}
WARM = um.WARM + json.dumps({"seconds": 3.0, "pace": 0.4})
PASSES = [um.PASS + json.dumps({"seconds": 2.0, "alloc_retries": 0}), um.PASS + json.dumps({"seconds": 2.1, "alloc_retries": 0})]


class FakeChild:
    def __init__(self, lines: list[str], code: int = 0):
        self.stdout = io.StringIO("".join(line + "\n" for line in lines))
        self.returncode, self.killed, self.waited = code, False, False
        CHILDREN.append(self)

    def poll(self):  # running until waited for (its result read) or killed
        return self.returncode if self.waited or self.killed else None

    def kill(self) -> None:
        self.killed = True

    def wait(self) -> int:
        self.waited = True
        return self.returncode


CHILDREN: list[FakeChild] = []


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """Export and child replaced: `fake(lines, code)` sets what the child prints."""
    monkeypatch.setattr(um, "unavailable", lambda device: None)
    monkeypatch.setattr("poros.harness.unsloth.export_bnb4bit", lambda store, folder: (folder / "config.json").write_text("{}"))

    def set_child(lines, code=0):
        monkeypatch.setattr(um.subprocess, "Popen", lambda *a, **k: FakeChild(lines, code))

    return set_child


def test_result_is_handed_over_before_the_export_is_removed(fake, monkeypatch, tmp_path):
    fake(["Unsloth: banner", WARM, "  unsloth pass 1/2: 5 steps in 2.00 s", *PASSES, um.RESULT + json.dumps(RECORD)])
    seen, logged = [], []

    def rmtree(folder, ignore_errors=False):
        assert seen, "the record must be handed over before the clean-up"
        raise KeyboardInterrupt  # a time budget's SIGINT arriving during the clean-up

    monkeypatch.setattr(um.shutil, "rmtree", rmtree)
    with pytest.raises(KeyboardInterrupt):
        um.measure_unsloth(None, TrainConfig(model="tiny-qwen3", device="cuda"), 5, 2, 1, workdir=str(tmp_path),
                           log=logged.append, on_record=seen.append)
    assert len(seen) == 1 and {k: v for k, v in seen[0].items() if k != "per_pass_s"} == \
        {k: v for k, v in RECORD.items() if k != "per_pass_s"}
    assert len(seen[0]["per_pass_s"]) == 2, "the passes as the parent's loop timed them"
    # the child's own lines reach the log as they come, and so does its result line
    assert "  unsloth| Unsloth: banner" in logged
    assert "  unsloth pass 1/2: 5 steps in 2.00 s" in logged
    assert any(line.startswith("  unsloth result: ") for line in logged)


def test_each_unsloth_pass_record_carries_the_host_load(fake, tmp_path, monkeypatch):
    """As every in-process pass does (poros/harness/timing.py `host_load`): a pass of a host-bound method timed on a
    busy host says so. Control: the load is the one read as the pass ended, not a constant."""
    fake(["Unsloth: banner", WARM, *PASSES, um.RESULT + json.dumps(RECORD)])
    loads = iter([3.5, 0.25])
    monkeypatch.setattr("poros.harness.timing.host_load", lambda: next(loads))
    seen = []
    um.measure_unsloth(None, TrainConfig(model="tiny-qwen3", device="cuda"), 5, 2, 1, workdir=str(tmp_path),
                       log=lambda line: None, on_pass=seen.append)
    assert [r["load_avg"] for r in seen] == [3.5, 0.25]


def test_a_failing_child_raises_with_its_last_words(fake, tmp_path):
    fake(["Traceback (most recent call last):", "RuntimeError: Gemma 4 requires transformers >= 5.5.0"], code=1)
    seen = []
    with pytest.raises(CapabilityError, match="exit 1.*Gemma 4 requires"):
        um.measure_unsloth(None, TrainConfig(model="tiny-qwen3", device="cuda"), 5, 2, 1, workdir=str(tmp_path),
                           log=lambda line: None, on_record=seen.append)
    assert seen == []
    assert not list(tmp_path.glob("poros-unsloth-*")), "the export is removed after a failure too"


def test_a_parent_stopped_mid_run_kills_the_child(fake, tmp_path):
    """SIGTERM (a `timeout`) while the child trains: the child goes too, its GPU memory with it."""
    fake(["Unsloth: banner", WARM, PASSES[0], PASSES[1]])

    def on_pass(rec):
        raise KeyboardInterrupt  # the Ctrl-C lands while the first pass is kept

    with pytest.raises(KeyboardInterrupt):
        um.measure_unsloth(None, TrainConfig(model="tiny-qwen3", device="cuda"), 5, 2, 1, workdir=str(tmp_path),
                           log=lambda line: None, on_pass=on_pass)
    assert CHILDREN[-1].killed
    assert not list(tmp_path.glob("poros-unsloth-*"))


def test_unsloth_runs_without_strict_determinism_and_gated_methods_keep_it():
    from poros.config import Method
    from poros.engine.methods.registry import config_for

    strict = TrainConfig(model="tiny-qwen3", device="cuda", deterministic=True)
    assert config_for(Method.UNSLOTH, strict).deterministic is False
    assert all(config_for(m, strict) is strict for m in (Method.POROS, Method.RESIDENT, Method.RESIDENT_GC))
