"""Move one request's KV between two processes (same as ``pdxfer demo``)."""

import sys

from pdxfer.demo.transfer_demo import main

sys.exit(main())
