"""`python -m jaxpaged.server [MODEL] [flags]`: the same as `jaxpaged serve [MODEL] [flags]`."""

import sys

from jaxpaged.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
