"""The delivery worker against an outbox consumer that stops fetching while SUCCEEDED records
wait (librdkafka's consumer does, now and then, after a broker restart: decision 025). The
stall is made by pausing the worker's partitions behind its back, the real consumer and broker
fetching nothing: the worker must notice that records wait, leave and join its group again,
and deliver the result, in the same process, once."""

from __future__ import annotations

import base64
import time

from ledger.settings import Settings
from tests.delivery_support import ScriptedReceiver, SteppedDeliveryRig, keys_seen
from tests.support import grant, project_in_process

TENANT, ACTOR, TOOL = "acme", "agent-7", "send_email"
SECRET = "whsec_" + base64.b64encode(b"outbox-stall-0123456789ab").decode()


def _until_received(rig: SteppedDeliveryRig, receiver: ScriptedReceiver, op_id: str) -> float:
    started = time.monotonic()
    while op_id not in keys_seen(receiver.received):
        assert time.monotonic() - started < 45, (
            f"{op_id} never delivered: {rig.delivery(TENANT, op_id, 'hooks')}, "
            f"{rig.worker.health.snapshot()}"
        )
        rig.step()
    return time.monotonic() - started


def test_an_outbox_that_stops_fetching_is_rejoined_and_the_result_delivered_once(
    isolated: Settings,
) -> None:
    grant(isolated, TENANT, actor=ACTOR, tool=TOOL, destinations=("hooks",))
    project_in_process(isolated)
    rig = SteppedDeliveryRig(isolated, tool=TOOL, actor=ACTOR, secret=SECRET, outbox_stall_s=1.0)
    receiver = ScriptedReceiver(SECRET)
    try:
        rig.webhook(TENANT, "hooks", receiver.url)
        _until_received(rig, receiver, rig.succeeded(TENANT))
        rejoins = rig.registry.get_sample_value("opledger_delivery_outbox_rejoins_total") or 0.0
        consumer = rig.worker.outbox.consumer
        assert consumer is not None and consumer.assignment()
        consumer.pause(consumer.assignment())  # the fetcher stops; nothing says so
        second = rig.succeeded(TENANT)
        took = _until_received(rig, receiver, second)
        after = rig.registry.get_sample_value("opledger_delivery_outbox_rejoins_total") or 0.0
        assert after - rejoins == 1, (rejoins, after)
        assert rig.worker.outbox.consumer is not consumer
        assert keys_seen(receiver.received)[second] == 1, "delivered once"
        print(f"\ndelivered {took:.1f}s after the outbox stopped fetching (bound 1 s)")
    finally:
        receiver.close()
        rig.close()
