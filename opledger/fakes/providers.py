"""The demo's tools, as adapters to the fake provider process (``opledger fake-provider run``).

``OPLEDGER_PROVIDERS=opledger.fakes.providers:from_settings`` makes the recovery worker (and the
demo's services) use these. A real installation points that variable at a function of its own
returning its own ``ledger.tools.Provider`` adapters.
"""

from __future__ import annotations

from datetime import timedelta

from ledger.settings import Settings
from ledger.tools import Provider, ProviderTerms
from opledger.fakes.http_provider import HttpToolProvider

#: The tool's call timeout is what the UNKNOWN detector waits after a dispatch with no owner.
CALL_TIMEOUT = timedelta(seconds=5)
#: How long the fake provider remembers idempotency keys (it never forgets unless told).
KEY_RETENTION = timedelta(hours=24)

#: tool -> whether a repeat with the same key is deduplicated by the provider
DEMO_TOOLS = {
    "send_email": True,
    "create_invoice": True,
    "post_slack_message": True,
    # Charging a card is the non-idempotent tool: every call is a new charge.
    "charge_card": False,
}


def terms(tool: str) -> ProviderTerms:
    return ProviderTerms(
        call_timeout=CALL_TIMEOUT, key_retention=KEY_RETENTION, repeat_safe=DEMO_TOOLS[tool]
    )


def from_settings(settings: Settings) -> list[Provider]:
    """HTTP adapters for every demo tool, at ``settings.fake_provider_url``."""
    return [HttpToolProvider(settings.fake_provider_url, tool, terms(tool)) for tool in DEMO_TOOLS]
