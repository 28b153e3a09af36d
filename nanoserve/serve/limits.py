"""The server's default limits, in one place for the CLI (which imports nothing heavy) and the app."""

DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # a request body beyond this is refused with a 413
DEFAULT_DRAIN_TIMEOUT = 30.0  # seconds requests in flight may take to finish after SIGTERM/SIGINT
