"""Sluice's Redis layer, by job: ``clients`` (the connections, and what
"Redis is away" looks like), ``scripts`` (a Lua script and the one way to
call one) and ``composition`` (several steps in one round trip, flows of
them written once)."""
