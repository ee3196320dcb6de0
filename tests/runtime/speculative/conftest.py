from support import one_thread  # noqa: F401  (autouse: tiny ops run on one thread)
