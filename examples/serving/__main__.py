"""`python -m examples.serving [--help]` from the repository root: the serving demo."""
import sys

from . import main

sys.exit(main())
