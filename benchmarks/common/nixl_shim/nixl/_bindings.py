from nixl_cu12._bindings import *  # noqa: F403
