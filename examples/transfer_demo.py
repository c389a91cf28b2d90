"""Move one request's KV between two processes and report it (same as
``pdxfer transfer-demo``; ``pdxfer demo`` is the served batch through router, prefill and
decode)."""

import sys

from pdxfer.agents.transfer_demo import main

sys.exit(main())
