"""The test layout, and the fast loop.

    tests/unit/         in this process: pure functions, captured graphs, one-process Trainer runs (seconds each)
    tests/integration/  a fresh interpreter each: the `sgdtp` commands, the docs' code blocks, the start-up hook,
                        errors raised before any rank starts, an offline install
    tests/distributed/  multi-process jobs (tests/distributed/jobs/*.py), one file per feature
    tests/helpers/      what tests and job scripts share: launching jobs, the models, the quiet Trainer
    tests/data/         recorded environments and topologies

Every test outside tests/unit starts processes and is marked ``distributed`` here, so ``pytest -m "not
distributed"`` is the fast loop (the unit tests alone) and ``pytest`` runs everything.
"""

from __future__ import annotations

from pathlib import Path

import helpers  # noqa: F401  (puts examples/ on sys.path: the example GPT is `import gpt`)
import pytest

UNIT = Path(__file__).resolve().parent / "unit"


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if UNIT not in item.path.resolve().parents:
            item.add_marker(pytest.mark.distributed)
