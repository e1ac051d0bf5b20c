"""The test layout, and the fast loop.

    tests/unit/         in this process: pure functions, captured graphs, one-process Trainer runs (seconds each)
    tests/integration/  a fresh interpreter each: the `sgdtp` commands, the docs' code blocks, the start-up hook,
                        errors raised before any rank starts, an offline install
    tests/distributed/  multi-process jobs (tests/distributed/jobs/*.py), one file per feature
    tests/helpers/      what tests and job scripts share: launching jobs, the models, the quiet Trainer
    tests/data/         recorded environments and topologies

Every test outside tests/unit starts processes and is marked ``distributed`` here, so ``pytest -m "not
distributed"`` is the fast loop (the unit tests alone) and ``pytest`` runs the default tier: everything but the
tests marked ``slow``, which ``pytest -m slow`` runs (the budget and the rule: tests/README.md).

Each test session compiles into its own Inductor cache, ``TORCHINDUCTOR_CACHE_DIR`` under the session's temporary
folder (one for both xdist workers of a run; every job inherits it): a run starts cold, as on a fresh CI machine,
never reads what an earlier run or another checkout left, and jobs of the same model and options share graphs.
"""

from __future__ import annotations

import os
from pathlib import Path

import helpers  # noqa: F401  (puts examples/ on sys.path: the example GPT is `import gpt`)
import pytest

UNIT = Path(__file__).resolve().parent / "unit"
#: Seconds each heavy file takes in the default run (measured: tests/README.md's table; unlisted files count 0).
#: Only their order matters: it is the order the two xdist workers take files in.
FILE_SECONDS = {
    "test_model_zoo.py": 420,
    "test_docs.py": 405,
    "test_sharding.py": 398,
    "test_checkpoints_and_resume.py": 377,
    "test_pipeline_parallel.py": 330,
    "test_data_parallel.py": 282,
    "test_faults.py": 178,
    "test_slurm.py": 135,
    "test_compile_cache.py": 180,
    "test_big_models.py": 75,
    "test_lightning_contract.py": 90,
    "test_tensor_parallel.py": 111,
    "test_fabric.py": 110,
    "test_no_hang.py": 110,
    "test_killed_compile.py": 87,
    "test_cli.py": 66,
    "test_regions.py": 60,
    "test_offline_install.py": 59,
}


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if UNIT not in item.path.resolve().parents:
            item.add_marker(pytest.mark.distributed)
    # Heaviest files first (xdist hands out whole files, in this order: --no-loadscope-reorder): the longest jobs
    # start at once and the short ones fill in at the end, so neither worker idles while the other finishes.
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))
    if config.option.markexpr:  # `-m slow`, `-m "not distributed"`, ...: the expression decides
        return
    # The default run (`python -m pytest -q`, CI) leaves the slow tier out: tests/README.md lists each slow test
    # with the default test that covers the same feature.
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture(scope="session", autouse=True)
def session_inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This run's own Inductor cache folder (shared by its xdist workers: their basetemps have one parent)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "inductor-cache"
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    # Jobs compile into this session's cache, never the user's default compile cache (a per-user folder that would
    # carry state from one run of the suite to the next); test_compile_cache.py gives its jobs folders of their own.
    os.environ["SGDTP_COMPILE_CACHE"] = "off"
    return folder
