"""Test helpers for Prometheus text: scrape a real endpoint, parse it with prometheus_client's own parser."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT = 10.0


@dataclass
class Scrape:
    """One scrape: families (name -> type) and every sample's value by (sample name, sorted labels)."""

    types: dict[str, str]
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]
    sample_names: set[str]

    def value(self, name: str, **labels: str) -> float:
        """A sample's value (0 when absent: a labelled counter not yet incremented is not exported)."""
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels`` (e.g. a histogram's count over ops)."""
        want = set(labels.items())
        return sum(v for (n, lbls), v in self.samples.items() if n == name and want <= set(lbls))


def parse(text: str) -> Scrape:
    types: dict[str, str] = {}
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
            names.add(sample.name)
    return Scrape(types, samples, names)


def scrape(address: str) -> Scrape:
    """GET http://address/metrics and parse it (asserting the exposition content type)."""
    response = httpx.get(f"http://{address}/metrics", timeout=SCRAPE_TIMEOUT)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4"), response.headers
    return parse(response.text)
