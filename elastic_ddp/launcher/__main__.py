"""``python -m elastic_ddp.launcher ARGS``: ``elastic-ddp launch ARGS``."""

import sys

from elastic_ddp.launcher.command import main

sys.exit(main())
