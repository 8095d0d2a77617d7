"""Expert parallelism on the tiny mixtral (experts split over the devices, routing replicated): see
layout_checks.py. One file per model so that the test processes share the models."""

from tests.parallel.layout_checks import layout_tests

globals().update(layout_tests("mixtral-ep"))
