import signal
import threading

from django.core.management.base import BaseCommand

from gateway.worker.pacer import pacer_run


class Command(BaseCommand):
    help = "Release delayed and paced jobs onto their lanes when they are due."

    def handle(self, *args, **options):
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        pacer_run(stop=stop)  # it logs its start, in the log format every process uses
