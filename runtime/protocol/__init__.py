"""Wire types: every message that crosses a socket is a msgspec Struct defined here."""
