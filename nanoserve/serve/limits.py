"""The server's default limits, in one place for the CLI (which imports nothing heavy) and the app."""

DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # a request body beyond this is refused with a 413
DEFAULT_DRAIN_TIMEOUT = 30.0  # seconds requests in flight may take to finish after SIGTERM/SIGINT
# Seconds a request body may go without a byte arriving before the request gets a 408 (as
# Apache's mod_reqtimeout body default): a stalled client must not hold a request open for good.
DEFAULT_BODY_TIMEOUT = 20.0
# After the drain timeout has ended what was in flight: how long their last events may take to
# be written, then how long uvicorn waits on the connections left before it cancels them. The
# process exits within --drain-timeout plus about these two, whatever the clients do.
ENDING_GRACE = 1.0
SHUTDOWN_GRACE = 1
# Seconds a client refused for a full waiting queue is told to wait (Retry-After) before trying
# again: about one decode batch's turnover on a small model, so a retry finds rows freed.
RETRY_AFTER_SECONDS = 1
# Requests that may wait for a row before new ones get a 503 (--max-waiting-requests), as
# Ollama's queue: enough that a burst of clients (64 streams on a 32-row server) waits its turn,
# bounded so that a flood is refused at once instead of queueing without limit.
DEFAULT_MAX_WAITING = 512
