"""`python -m precompute`: encoder-precompute."""

import sys

from .cli import main

sys.exit(main())
