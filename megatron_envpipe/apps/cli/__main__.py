"""``python -m megatron_envpipe.apps.cli``: the ``envpipe`` command without its console script."""

import sys

from megatron_envpipe.apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
