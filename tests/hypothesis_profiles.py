"""Hypothesis profiles of the fuzz tests (``tests/**/test_*_fuzz.py``), chosen by ``DKV_FUZZ_PROFILE``.

* ``ci`` (the default): few examples, no deadline, derandomized and without
  an example database, so a CI run is deterministic and leaves nothing behind.
* ``long``: :data:`LONG_FACTOR` times as many examples, random seeds (each run
  explores new inputs), still no database; ``scripts/fuzz.py`` runs the fuzz
  tests under it for a time budget.

Each fuzz test module imports this module first, and sizes its own tests with
:func:`examples` (its CI count, scaled up in the long profile).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE_ENV = "DKV_FUZZ_PROFILE"
SCALE_ENV = "DKV_FUZZ_SCALE"  # the long profile's factor over the CI counts (default LONG_FACTOR)
CI, LONG = "ci", "long"
LONG_FACTOR = 20
CI_EXAMPLES = 50  # a test that does not size itself
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]

settings.register_profile(CI, max_examples=CI_EXAMPLES, deadline=None, derandomize=True, database=None,
                          print_blob=True, suppress_health_check=_SLOW_OK)
settings.register_profile(LONG, max_examples=CI_EXAMPLES * LONG_FACTOR, deadline=None, database=None,
                          print_blob=True, suppress_health_check=_SLOW_OK)

PROFILE = os.environ.get(PROFILE_ENV, CI)
if PROFILE not in (CI, LONG):
    raise ValueError(f"{PROFILE_ENV}={PROFILE!r}: expected {CI!r} or {LONG!r}")
settings.load_profile(PROFILE)


def scale() -> int:
    """How many times its CI count of examples a test runs under the loaded profile (1 in ``ci``)."""
    if PROFILE == CI:
        return 1
    return max(1, int(os.environ.get(SCALE_ENV, LONG_FACTOR)))


def examples(ci: int) -> int:
    """A test's example count: ``ci`` in the CI profile, scaled up in the long one."""
    return ci * scale()
