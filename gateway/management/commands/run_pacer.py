import logging
import signal
import threading

from django.core.management.base import BaseCommand

from budgets.redis.clients import request_path_process
from gateway.worker.pacer import WAIT_MAX_S, StopFlag, held_start, pacer_run
from gateway.worker.prober import prober_start

# The prober's probe ends within its timeout; waiting longer would only delay
# the exit (its thread is a daemon and dies with the process anyway).
PROBER_JOIN_S = 2.5

logger = logging.getLogger("gateway.worker.pacer")


class Command(BaseCommand):
    help = "Release delayed and paced jobs onto their lanes when they are due, and probe the pools."

    def handle(self, *args, **options):
        request_path_process()  # it moves requests onto lanes: a busy Redis is waited for
        stop = StopFlag()
        # The handlers only set a flag (gateway/worker/pacer.py says why).
        signal.signal(signal.SIGTERM, stop.request)
        signal.signal(signal.SIGINT, stop.request)
        prober_stop = threading.Event()
        prober = prober_start(stop=prober_stop)
        # Held requests' releases, beside the loop (it sees the same flag).
        held = held_start(stop=stop)
        # pacer_run logs its start, in the log format every process uses.
        try:
            pacer_run(stop=stop)
        finally:
            prober_stop.set()  # from the main thread, outside any signal handler
            if prober is not None:
                prober.join(timeout=PROBER_JOIN_S)
            stop.request()  # pacer_run may have ended on an error
            held.join(timeout=WAIT_MAX_S + PROBER_JOIN_S)
        logger.info("pacer stopped")
