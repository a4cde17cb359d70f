"""Prometheus scrapes as tests read them: every sample, summed by name and labels."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Samples:
    """One scrape's samples: (name, labels, value)."""

    samples: tuple[tuple[str, dict[str, str], float], ...]
    text: str

    @classmethod
    def parse(cls, text: str) -> Samples:
        return cls(
            tuple(
                (s.name, dict(s.labels), s.value)
                for family in text_string_to_metric_families(text)
                for s in family.samples
            ),
            text,
        )

    def names(self) -> set[str]:
        return {name for name, _, _ in self.samples}

    def value(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``; KeyError
        when the scrape has no sample of that name at all."""
        found = [v for n, ls, v in self.samples if n == name]
        if not found:
            raise KeyError(f"no {name} in the scrape")
        return sum(
            v
            for n, ls, v in self.samples
            if n == name and all(ls.get(k) == want for k, want in labels.items())
        )

    def labels(self, name: str) -> list[dict[str, str]]:
        return [ls for n, ls, _ in self.samples if n == name]


def scrape(url: str, timeout: float = 10.0) -> Samples:
    """GET a /metrics endpoint (raises on anything but 200)."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        assert response.status == 200, response.status
        return Samples.parse(response.read().decode())
