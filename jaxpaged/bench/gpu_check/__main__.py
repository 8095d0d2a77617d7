"""python -m jaxpaged.bench.gpu_check [--dry-run]: see driver.py."""

from jaxpaged.bench.gpu_check.driver import main

if __name__ == "__main__":
    raise SystemExit(main())
