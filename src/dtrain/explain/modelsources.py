"""The cost model's inputs in words: each with where it came from (:class:`Source`: a term's own
:class:`~dtrain.explain.terms.base.Input`), as ``dtrain plan`` and the doctor list them."""

from __future__ import annotations

from dtrain.explain.facts import Facts, Work
from dtrain.explain.network import Link, RingLink
from dtrain.explain.terms.base import Input as Source


def link_words(link: RingLink, residual: float) -> str:
    return (f"{1e6 * link.step_latency:.0f} us per ring step, {link.busbw / 1e6:,.0f} MB/s (fit residual "
            f"{100 * residual:.0f}%)")


def between_source(between_hosts: Link, f: Facts) -> Source:
    replaces = " (replaces the link measured between the run's hosts)" if f.hosts > 1 else ""
    burst = f", a shaper's {between_hosts.burst_bytes:,.0f}-byte burst" if between_hosts.burst_bytes else ""
    return Source("link between hosts", between_hosts.label + burst + replaces, "given")


def describe_work(work: Work) -> str:
    return "; ".join(f"{t} thread(s): {1e3 * a:.3f} ms + {1e6 * c:.2f} us/sample" for t, (a, c) in
                     sorted(work.points.items()))
