"""``python -m tiertrain.cli``: the ``tiertrain`` command (the form torchrun's ``-m`` starts)."""
import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
