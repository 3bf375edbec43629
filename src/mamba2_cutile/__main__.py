import sys

from .cli import main

if __name__ == "__main__":      # not in worker processes (bench --compile-jobs spawns them)
    sys.exit(main())
