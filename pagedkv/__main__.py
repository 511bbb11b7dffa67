"""`python -m pagedkv` is the `pagedkv` command."""

import sys

from pagedkv.cli import main

if __name__ == "__main__":
    sys.exit(main())
