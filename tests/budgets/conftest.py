from tests.people import login, world  # noqa: F401  (fixtures of the alerts page and service tests)
