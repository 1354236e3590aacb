"""ASGI entry point. The OpenAI-compatible API is served by async views on
uvicorn: a request waiting for its lane's worker parks on an awaitable Redis
read, not on a thread."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llm_platform.settings")
application = get_asgi_application()
