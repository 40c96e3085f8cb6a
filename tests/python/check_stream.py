"""Reads an outbox stream with nats-py, a client this project did not write, and checks the wire
format outbox-nats promises: one message per event, `Nats-Msg-Id` equal to `Outbox-Event-Id`, the
`Outbox-*` headers, the envelope as the body, and each aggregate's events in commit order.

Usage: check_stream.py <nats url> <stream> <subject prefix> <expected messages>
Prints a JSON summary; exits non-zero (with the reason) on the first violation.
"""

import asyncio
import json
import sys

import nats


def fail(reason):
    print(json.dumps({"ok": False, "reason": reason}))
    sys.exit(1)


async def main(url, stream, prefix, expected):
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        if info.state.messages != expected:
            fail(f"the stream holds {info.state.messages} messages, not {expected}")
        last = {}  # aggregate id -> (event id, seq)
        versions = set()
        for sequence in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(stream, sequence)
            headers = msg.headers or {}
            for name in ("Nats-Msg-Id", "Outbox-Event-Id", "Outbox-Event-Type",
                         "Outbox-Event-Version", "Outbox-Aggregate-Type",
                         "Outbox-Aggregate-Id", "Outbox-Occurred-At"):
                if name not in headers:
                    fail(f"message {sequence} has no {name} header: {headers}")
            event_id = int(headers["Outbox-Event-Id"])
            if headers["Nats-Msg-Id"] != str(event_id):
                fail(f"message {sequence}: Nats-Msg-Id {headers['Nats-Msg-Id']} is not its event id")
            event_type = headers["Outbox-Event-Type"]
            aggregate_type = headers["Outbox-Aggregate-Type"]
            if msg.subject != f"{prefix}.{aggregate_type}.{event_type}":
                fail(f"message {sequence} is on {msg.subject}")
            envelope = json.loads(msg.data)
            if set(envelope) != {"version", "data", "metadata"}:
                fail(f"message {sequence}: the body is not an envelope: {envelope}")
            if str(envelope["version"]) != headers["Outbox-Event-Version"]:
                fail(f"message {sequence}: version {envelope['version']} against its header")
            versions.add(envelope["version"])
            correlation = envelope["metadata"].get("correlation_id")
            if correlation is not None and headers.get("Outbox-Correlation-Id") != correlation:
                fail(f"message {sequence}: correlation id {correlation} not in its headers")
            aggregate = headers["Outbox-Aggregate-Id"]
            seq = envelope["data"]["seq"]
            if aggregate in last:
                before, before_seq = last[aggregate]
                if not (before < event_id and before_seq + 1 == seq):
                    fail(f"aggregate {aggregate}: event {event_id} (seq {seq}) after "
                         f"{before} (seq {before_seq})")
            elif seq != 0:
                fail(f"aggregate {aggregate} starts at seq {seq}")
            last[aggregate] = (event_id, seq)
        print(json.dumps({"ok": True, "messages": info.state.messages,
                          "aggregates": len(last), "versions": sorted(versions)}))
    finally:
        await nc.close()


if __name__ == "__main__":
    url, stream, prefix, expected = sys.argv[1:5]
    asyncio.run(main(url, stream, prefix, int(expected)))
