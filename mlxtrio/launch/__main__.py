"""``python -m mlxtrio.launch``: the same as ``mlxtrio launch``."""

import sys

from .command import main

sys.exit(main())
