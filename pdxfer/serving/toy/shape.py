"""The toy model's page size and context length by default, written once.

``WorkerConfig``'s ``--page-size`` and ``--max-seq-len`` (their help) and ``ToyConfig``'s
fields both take them from here: ``config`` cannot import ``model`` (torch) to read them,
and ``model`` importing ``config`` would close a circle.
"""

PAGE_SIZE = 16
MAX_SEQ_LEN = 1024
