"""Where refshare meets Ray: its submit path, its pickler and the running session."""
