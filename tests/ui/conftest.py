from tests.people import login, world  # noqa: F401  (fixtures of the web UI and API tests)
