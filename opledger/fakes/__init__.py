"""Fake tool providers for tests, chaos runs, the demo and benchmarks.

The seed's harness: "a fake tool that records every received idempotency key", counting every side
effect so a run can prove that one logical operation produced at most one non-idempotent change.

- :mod:`opledger.fakes.model` and :mod:`opledger.fakes.state`: the behaviour and the counts,
  shared by both fakes.
- :mod:`opledger.fakes.provider_server`: the fake as its own process (``opledger fake-provider
  run``), so it outlives a SIGKILLed caller and still knows what the outside world saw.
- :mod:`opledger.fakes.http_provider`: ``ledger.tools.Provider``/``AsyncProvider`` adapters over
  HTTP, and a client for the server's control API.
- :mod:`opledger.fakes.memory`: the same behaviour in-process, for unit tests and benchmarks.

Nothing here is imported by ``opledger stack`` or the projector: this package stays light.
"""
