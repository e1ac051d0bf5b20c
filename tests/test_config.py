"""Options: one validated description, same errors from every entry point, before any process exists."""

from __future__ import annotations

import pytest

from lightning_sgdtp import NotAvailableYetError, SGDTPConfig, SGDTPConfigError, SGDTPStrategy


def test_defaults_and_options_dict() -> None:
    cfg = SGDTPConfig.from_options({"distributed": {"plugin": "sgdtp", "strategy": "data", "bucket_cap_mb": 4}})
    assert cfg.parallelism == "data" and cfg.bucket_cap_mb == 4 and cfg.bucket_cap_bytes == 4 * 2**20
    assert SGDTPConfig().bucket_cap_mb == 25


def test_explicit_keywords_win_over_options() -> None:
    s = SGDTPStrategy(
        bucket_cap_mb=8, options={"distributed": {"plugin": "sgdtp", "strategy": "data", "bucket_cap_mb": 2}}
    )
    assert s.config.bucket_cap_mb == 8


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"parallelism": "zero3"}, SGDTPConfigError, ["parallelism", "'data'"]),
        ({"pipeline_chunks": 4}, NotAvailableYetError, ["pipeline_chunks", "not available yet"]),
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
        {"distributed": {"plugin": "sgdtp", "strategy": "data", "pipeline_chunks": 4}},
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
