from nixl_cu12._api import *  # noqa: F403
