"""A one-shot check of the engine on a lent GPU: kernels, bandwidth, swap, start-up and step, engine end to end.

Run it with scripts/gpu_check.sh (see pallas_kernels/RESULTS.md); the parts and how they run
are described in driver.py.
"""
