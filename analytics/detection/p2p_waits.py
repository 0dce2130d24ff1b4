"""Whether point-to-point timers hold waits when their producer did not say (``includes_wait``).

A producer declares fused or blocking p2p timers (``TracingDeclared.fused_p2p``, each record's
``includes_wait``); one that skipped docs/dialects.md says nothing, and its timers are then read as
wire-only: centred on the median link and allowed to name a link. A Megatron-style fused
send+recv timer holds the wait for the peer, the pipeline bubble included, so read as a wire it
makes healthy links ×10–×10⁵ slow in single iterations (the long-document burst family of
``resihp bench detect``, undeclared: 144 link incidents in 120 iterations of a healthy job).

The data tell them apart. A wire-only timer's time per message follows the message (its bytes,
else its tokens, which packing keeps within a factor of two or so of each other), latency and
the wire's noise: its messages on one link lie within a few × of each other in every iteration.
A timer that holds the wait grows with the peer's compute and with the bubble: on the same link
one message waits for a whole chunk of the peer and the next for nothing. So when, in one
iteration, the median link's spread (its slowest message over its fastest, per byte when sizes
are known) passes ``WAIT_SPREAD``, the undeclared timers cannot be wire-only; from then on the
job's undeclared p2p send timers are read as holding waits, and the detector says so once.
A slow wire slows every message of the link alike and leaves the spread as it was; a congested
message or two on one link do not move the median link.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from analytics.detection.frame import OP_CODE, IterationFrame
from analytics.detection.scoring import message_times

P2P_SEND_OPS = (OP_CODE["pp_send"], OP_CODE["pp_sendrecv"])
WAIT_SPREAD = 8.0  # the median link's slowest message over its fastest, beyond which timers hold waits
NOTICE = "p2p timers hold waits; declare `fused_p2p`"


def undeclared_spread(frame: IterationFrame) -> float:
    """The median, over links with two or more undeclared p2p send records in ``frame``, of the
    link's slowest time per message over its fastest (per byte when sizes are known); NaN when no
    link has two."""
    sel = np.isin(frame.k_op, P2P_SEND_OPS) & ~frame.k_wait & (frame.k_peer >= 0) & (frame.k_dur > 0)
    if sel.sum() < 2:
        return float("nan")
    _, link, per, _ = message_times(frame, sel)
    n = int(link.max()) + 1
    hi = np.full(n, -np.inf)
    lo = np.full(n, np.inf)
    np.maximum.at(hi, link, per)
    np.minimum.at(lo, link, per)
    count = np.bincount(link, minlength=n)
    ratios = (hi / lo)[count >= 2]
    return float(np.median(ratios)) if len(ratios) else float("nan")


@dataclass
class P2PWaitInference:
    """Per job: whether its undeclared p2p timers are known to hold waits (sticky: a producer's
    timers do not change kind), and whether the detector has said so."""

    holds_waits: bool = False
    spread: float = float("nan")  # the spread that decided it

    def read(self, frame: IterationFrame) -> tuple[IterationFrame, bool]:
        """``frame`` with its undeclared p2p send timers marked as holding waits once they are known
        to, and whether this frame is the one that told."""
        told = False
        if not self.holds_waits:
            spread = undeclared_spread(frame)
            if not spread > WAIT_SPREAD:
                return frame, False
            self.holds_waits, self.spread, told = True, spread, True
        undeclared = np.isin(frame.k_op, P2P_SEND_OPS) & ~frame.k_wait
        if not undeclared.any():
            return frame, told
        return replace(frame, k_wait=frame.k_wait | undeclared), told
