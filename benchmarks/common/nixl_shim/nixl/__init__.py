"""``nixl`` as vLLM imports it (``nixl._api``), re-exported from the ``nixl-cu12`` wheel, which
installs as ``nixl_cu12``. Only the benchmark puts this folder on a vLLM process's PYTHONPATH
(for vLLM's own NixlConnector); pdxfer itself imports ``nixl_cu12`` directly."""

from nixl_cu12 import *  # noqa: F403
