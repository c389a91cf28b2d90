"""pdxfer as SGLang's disaggregation transfer backend (``--disaggregation-transfer-backend
pdxfer``). Reading order: ``plugin`` (how SGLang finds it) -> ``pools`` (KVArgs as pdxfer
pools, pure) -> ``conn`` (manager, sender, receiver, bootstrap server). Importing this package
imports no SGLang; ``plugin.register`` and ``conn`` do.
"""
