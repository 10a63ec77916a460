"""The seed's analyses as functions returning JSON-serialisable dataclasses."""
