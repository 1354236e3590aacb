"""The garbage collector of the request path's long-lived processes (the web
process, every lane worker).

Python's default collects its youngest generation every 700 net allocations,
and each collection walks every young container; a request allocates
thousands (Django's request and response, redis-py's commands, Celery's
message and JSON), so an admitted request paid several collections in each
process it crossed. Off is not an option (reference cycles in Django and
Celery would grow without bound), so: everything alive once the process is
ready (settings, URL resolvers, loaded modules) is frozen out of every
collection, and the youngest generation is collected every 20,000
allocations."""

import gc

YOUNG_THRESHOLD = 20_000


def gc_tune() -> None:
    """Call once the process has imported and built what it keeps for life."""
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
