"""The recovery worker (``opledger recover run``)."""
