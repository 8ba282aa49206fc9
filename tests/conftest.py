"""Settings every test directory shares.

Hypothesis runs derandomised by default (profile ``ci``): the examples are a function of the
test alone, so a failure seen in CI reproduces with the same command on any machine.
``HYPOTHESIS_PROFILE=explore`` draws fresh random examples on each run (and keeps failures in
the local example database) to hunt for new ones."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
