"""What the tests and the job scripts share, in one place (job scripts import these, never each other).

- ``helpers.launch``: the test side: start a job script with a hard timeout, read what it wrote, compare parameters.
- ``helpers.models``: the small LightningModules and the token data the jobs train.
- ``helpers.training``: the job side: the quiet Trainer, parameters as full tensors, first-step gradients.

Importing this package puts ``examples/`` on ``sys.path`` (the example GPT: ``import gpt``, ``import data``).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
EXAMPLES = REPO / "examples"
DATA = TESTS / "data"
JOBS = TESTS / "distributed" / "jobs"

if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
