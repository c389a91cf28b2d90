"""Move one request's KV between two processes (same as ``pdxfer demo``)."""

import sys

from pdxfer.agents.transfer_demo import main

sys.exit(main())
