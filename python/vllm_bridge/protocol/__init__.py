"""The wire protocol between the Elixir runtime and a Python worker (docs/PROTOCOL.md)."""
