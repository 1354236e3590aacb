"""Sluice's adapters: the one place where a library's private names are used
or its behaviour is overridden, and only where a measured gain pays for it
(docs/architecture.md, "Library internals").

One module per library. Each module's docstring names the library versions
it was written against, what it replaces, its measured gain (the number and
the bench command that reproduces it) and the test that fails when an
upgrade changes what it relies on. ``tests/test_library_internals.py`` fails when
any module outside this package touches a third-party private name.

This package imports no Sluice app: the apps import it."""
