"""``python -m mlxtrio serve ...``: the ``mlxtrio`` command, runnable by module
name, as ``mlx.launch`` starts every rank (``mlx.launch ... -m mlxtrio serve``)."""

import sys

from .cli import main

sys.exit(main())
