"""Options: one validated description, same errors from every entry point, before any process exists."""

from __future__ import annotations

import pytest

from lightning_sgdtp import NotAvailableYetError, SGDTPConfig, SGDTPConfigError, SGDTPStrategy


def test_defaults_and_options_dict() -> None:
    cfg = SGDTPConfig.from_options({"distributed": {"plugin": "sgdtp", "strategy": "data", "bucket_cap_mb": 4}})
    assert cfg.parallelism == "data" and cfg.bucket_cap_mb == 4 and cfg.bucket_cap_bytes == 4 * 2**20
    default = SGDTPConfig()
    assert default.bucket_cap_mb == "auto" and default.measured_buckets and default.bucket_cap_bytes == 25 * 2**20
    assert default.optimizer_update == "auto" and default.profile_steps is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bucket_cap_mb": "big"}, "'auto'.*or a number of MiB"),
        ({"optimizer_update": "fastest"}, "optimizer_update='fastest' is not known"),
        ({"profile_steps": (12, 10)}, r"profile_steps=\(12, 10\) must be \(first, last\)"),
        ({"profile_steps": 10}, "profile_steps=10 must be"),
    ],
)
def test_speed_options_are_checked(kwargs: dict, match: str) -> None:
    with pytest.raises(SGDTPConfigError, match=match):
        SGDTPConfig(**kwargs)
    assert SGDTPConfig(profile_steps=[3, 4]).profile_steps == (3, 4)


def test_explicit_keywords_win_over_options() -> None:
    s = SGDTPStrategy(
        bucket_cap_mb=8, options={"distributed": {"plugin": "sgdtp", "strategy": "data", "bucket_cap_mb": 2}}
    )
    assert s.config.bucket_cap_mb == 8


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"parallelism": "zero3"}, SGDTPConfigError, ["parallelism", "'data'"]),
        ({"pipeline_chunks": 0}, SGDTPConfigError, ["pipeline_chunks", ">= 1"]),
        ({"pipeline_stages": 1}, SGDTPConfigError, ["pipeline_stages", ">= 2"]),
        ({"pipeline_stages": 2.0}, SGDTPConfigError, ["pipeline_stages", "int"]),
        ({"pipeline_schedule": "gpipe"}, SGDTPConfigError, ["pipeline_schedule", "set pipeline_stages"]),
        ({"pipeline_stages": 2, "pipeline_schedule": "zero_bubble"}, SGDTPConfigError, ["'1f1b'", "'gpipe'"]),
        ({"pipeline_stages": 4, "pipeline_chunks": 2}, SGDTPConfigError, ["'1f1b'", "pipeline_chunks >= 4"]),
        (
            {"pipeline_stages": 2, "pipeline_chunks": 5, "pipeline_schedule": "interleaved_1f1b"},
            SGDTPConfigError,
            ["multiple of", "5"],
        ),
        ({"pipeline_stages": 2, "parallelism": "hybrid"}, SGDTPConfigError, ["tensor_parallel_size", "'tensor'"]),
        ({"pipeline_stages": 2, "shard_size": 2}, SGDTPConfigError, ["shard_size=2", "sharding='full'"]),
        ({"pipeline_stages": 2, "compile_cache": "/tmp/c"}, NotAvailableYetError, ["compile_cache", "not available"]),
        ({"pipeline_stages": 2, "pipeline_split": ["a", "b"]}, SGDTPConfigError, ["2 names for 2 stages"]),
        ({"pipeline_stages": 2, "pipeline_split": "model.blocks.1"}, SGDTPConfigError, ["list of module names"]),
        ({"pipeline_stages": 2, "pipeline_stages_per_rank": 2}, SGDTPConfigError, ["'interleaved_1f1b' only"]),
        ({"pipeline_stages": 2, "pipeline_balance": "flops"}, SGDTPConfigError, ["'params'", "'measured'"]),
        ({"tensor_parallel_size": 2}, SGDTPConfigError, ["tensor_parallel_size", "parallelism='tensor' or 'hybrid'"]),
        ({"tp_plan": {"a": "colwise"}}, SGDTPConfigError, ["tp_plan", "parallelism='tensor' or 'hybrid'"]),
        ({"parallelism": "hybrid", "tensor_parallel_size": 0}, SGDTPConfigError, ["tensor_parallel_size", "'auto'"]),
        ({"parallelism": "hybrid", "tensor_parallel_size": "two"}, SGDTPConfigError, ["positive int"]),
        ({"parallelism": "tensor", "tp_plan": {"a.*": "diagonal"}}, SGDTPConfigError, ["tp_plan['a.*']", "colwise"]),
        ({"parallelism": "tensor", "tp_plan": {}}, SGDTPConfigError, ["tp_plan", "non-empty"]),
        ({"parallelism": "hybrid", "activation_checkpointing": True}, NotAvailableYetError, ["parallelism='data'"]),
        ({"bucket_cap_mb": 0}, SGDTPConfigError, ["bucket_cap_mb", "> 0"]),
        ({"bucket_cap_mb": -3}, SGDTPConfigError, ["bucket_cap_mb"]),
        ({"bucket_cap_mb": "25"}, SGDTPConfigError, ["bucket_cap_mb", "number"]),
        ({"grad_comm_dtype": "fp8"}, SGDTPConfigError, ["grad_comm_dtype", "'bf16'"]),
        ({"collective_timeout": 0}, SGDTPConfigError, ["collective_timeout"]),
    ],
)
def test_invalid_options_name_the_option_and_the_fix(kwargs: dict, error: type, names: list[str]) -> None:
    with pytest.raises(error) as info:
        SGDTPStrategy(**kwargs)
    for name in names:
        assert name in str(info.value)


@pytest.mark.parametrize(
    "options",
    [
        {"distributed": {"plugin": "sgdtp", "strategy": "hybrid", "pipeline_chunks": 4}},
        {"distributed": {"plugin": "other"}},
        {"distributed": {"plugin": "sgdtp", "bucket_size": 3}},
        {"mode": "max-autotune"},
    ],
)
def test_invalid_options_dict(options: dict) -> None:
    with pytest.raises((SGDTPConfigError, NotAvailableYetError)):
        SGDTPConfig.from_options(options)


def test_tensor_strategy_in_options_dict_is_not_silently_data() -> None:
    s = SGDTPStrategy(options={"distributed": {"plugin": "sgdtp", "strategy": "hybrid", "tensor_parallel_size": 2}})
    assert (s.config.parallelism, s.config.tensor_parallel_size) == ("hybrid", 2)


def test_pipeline_options_dict_of_the_design_documents() -> None:
    s = SGDTPStrategy(options={"distributed": {"plugin": "sgdtp", "strategy": "data", "pipeline_chunks": 4}})
    c = s.config
    assert c.pipelined and (c.pipeline_chunks, c.pipeline_stages, c.pipeline_schedule) == (4, None, "1f1b")
    assert SGDTPConfig(pipeline_stages=2).pipeline_micro_batches(2) == 4  # default: 2 x stages
    assert SGDTPConfig(pipeline_stages=2, pipeline_schedule="interleaved_1f1b").pipeline_micro_batches(2) == 8


@pytest.mark.parametrize(
    ("devices", "kwargs", "names"),
    [
        (3, {"pipeline_stages": 2}, ["pipeline_stages=2 must divide the 3 ranks", "[3]"]),
        (4, {"pipeline_chunks": 2}, ["'1f1b'", "pipeline_chunks >= 4"]),  # auto: 4 stages on one node
        (
            2,
            {"pipeline_stages": 2, "pipeline_schedule": "interleaved_1f1b", "pipeline_split": ["a"]},
            ["4 stages: give 3"],
        ),
    ],
)
def test_pipeline_sizes_fail_before_any_process_starts(devices: int, kwargs: dict, names: list[str]) -> None:
    import lightning.pytorch as L

    with pytest.raises(SGDTPConfigError) as info:
        L.Trainer(accelerator="cpu", devices=devices, strategy=SGDTPStrategy(**kwargs), logger=False)
    for name in names:
        assert name in str(info.value)


def test_the_strategy_takes_every_option_once_typed_and_documented() -> None:
    """SGDTPStrategy's signature is SGDTPConfig's fields (one declaration per option): LightningCLI's parser reads
    the types (a bad value is refused at parse time) and the help text of each."""
    import dataclasses
    import inspect

    import jsonargparse  # the [test] extra: jsonargparse[signatures], docstring-parser with it

    from lightning_sgdtp import SGDTPStrategy

    params = inspect.signature(SGDTPStrategy).parameters
    assert [f.name for f in dataclasses.fields(SGDTPConfig)] == [
        p for p in params if p in SGDTPConfig.__dataclass_fields__
    ]
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(SGDTPStrategy, "strategy")
    parsed = parser.parse_args(
        ["--strategy.bucket_cap_mb=10", "--strategy.sharding=full", "--strategy.profile_steps=[3, 4]"]
    )
    strategy = parser.instantiate(parsed).strategy
    assert (strategy.config.bucket_cap_mb, strategy.config.sharding, strategy.config.profile_steps) == (
        10,
        "full",
        (3, 4),
    )
    assert strategy.config.parallelism == "data"  # not given: the option's default
    with pytest.raises(jsonargparse.ArgumentError, match="parallelism"):
        parser.parse_args(["--strategy.parallelism=bogus"])
    help_text = parser.format_help()
    assert "bucket boundaries chosen per backward graph" in " ".join(help_text.split())
    with pytest.raises(SGDTPConfigError, match="unknown option"):
        SGDTPStrategy(bucket_size=3)
