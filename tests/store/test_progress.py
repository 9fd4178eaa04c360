"""LayerProgress: the per-layer callback and the `\\rWHAT: layer i/n` line on stderr."""

from __future__ import annotations

from poros.store.progress import LayerProgress


def test_progress_calls_back_and_prints_each_layer(capsys):
    seen = []
    p = LayerProgress("building", 3, show=True, on_layer=lambda i, n: seen.append((i, n)))
    for i in (1, 2, 3):
        p(i)
    p.done()
    assert seen == [(1, 3), (2, 3), (3, 3)]
    err = capsys.readouterr().err
    assert err == "\rbuilding: layer 1/3\rbuilding: layer 2/3\rbuilding: layer 3/3\n"


def test_progress_hidden_still_calls_back(capsys):
    seen = []
    p = LayerProgress("loading", 2, show=False, on_layer=lambda i, n: seen.append(i))
    p(1)
    p(2)
    p.done()
    assert seen == [1, 2]
    assert capsys.readouterr().err == ""


def test_progress_shows_by_default_only_on_a_terminal(monkeypatch):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert LayerProgress("x", 1, show=None).show is False
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert LayerProgress("x", 1, show=None).show is True
