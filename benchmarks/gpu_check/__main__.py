"""python -m benchmarks.gpu_check [--dry-run]: see driver.py."""

from benchmarks.gpu_check.driver import main

if __name__ == "__main__":
    raise SystemExit(main())
