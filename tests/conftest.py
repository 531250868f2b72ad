"""Makes the repository and the shared test helpers importable without an install.

Tests live in one folder per subpackage (tests/comm, tests/attention, ...); the helpers they
share (``_dist``, ``_megatron_cpu``, the references) stay here, so this folder goes on the path.
"""

import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
for path in (ROOT, TESTS):
    if path not in sys.path:
        sys.path.insert(0, path)
