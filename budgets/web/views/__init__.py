"""Web UI pages (server-rendered). Thin: fetch through selectors that take
the user or tenant, call one service on POST, render."""
