"""The sequence-chunk settings (`loss_chunk`, `mlp_chunk`, `attention_chunk`): off by default, taken from a
flag's string, recorded in rows, and a bad value refused in one line that names the field."""

from __future__ import annotations

import argparse

import pytest

from poros.config import TrainConfig
from poros.errors import ConfigError
from poros.cli.flags import add_arguments, from_arguments

CHUNKS = ["loss_chunk", "mlp_chunk", "attention_chunk"]


@pytest.mark.parametrize("field", CHUNKS)
def test_the_setting(field):
    assert getattr(TrainConfig(model="tiny-qwen3"), field) is None
    assert getattr(TrainConfig(model="tiny-qwen3", **{field: "4096"}), field) == 4096  # as a flag gives it
    assert TrainConfig(model="tiny-qwen3", **{field: 4096}).as_dict()[field] == 4096  # rows record it


@pytest.mark.parametrize("bad", [0, -4, 1.5, True, "many", 2**40], ids=repr)
@pytest.mark.parametrize("field", CHUNKS)
def test_bad_values_are_refused_in_one_line_naming_the_field(field, bad):
    with pytest.raises(ConfigError) as e:
        TrainConfig(model="tiny-qwen3", **{field: bad})
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(f"{field}: expected an integer > 0")
    assert "\n" not in str(e.value)


def test_the_flags_come_from_the_settings_table():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--loss-chunk", "2048", "--attention-chunk", "4096", "--mlp-chunk", "1024"])
    cfg = TrainConfig.from_settings(from_arguments(args), model="tiny-qwen2")
    assert (cfg.loss_chunk, cfg.attention_chunk, cfg.mlp_chunk) == (2048, 4096, 1024)
