"""Messages on a subject the edge listens to that are none of what is sent there.

Anything that may publish on such a subject (a node on its own subjects; the JetStream server made to
answer there, docs/security.md) could otherwise write one log line per message. Each is counted
(`iop_nats_undecodable_total`) and logged at most once a minute, with the count so far.
"""

from __future__ import annotations

import logging
from time import monotonic

from iop.edge.intake import printable

log = logging.getLogger("iop.edge")

LOG_EVERY_S = 60.0


class Junk:
    """The undecodable messages of one kind (`hello`, `heartbeat`, `reply`, `edge_slots`)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.count = 0
        self._logged = -LOG_EVERY_S

    def dropped(self, subject: str) -> None:
        """One more dropped: logged if none was in the last minute."""
        self.count += 1
        now = monotonic()
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            log.warning(
                "undecodable %s messages dropped (last on %s): %d so far (iop_nats_undecodable_total)",
                self.kind,
                printable(subject),
                self.count,
            )
