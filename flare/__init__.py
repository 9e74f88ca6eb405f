"""Flare: always-on diagnosis of distributed LLM training.

The house folders are installed under this namespace: `flare.schemas` (schemas/),
`flare.detectors` (detectors/), `flare.producers` (producers/), `flare.streams` (streams/),
`flare.api` (api/) and `flare.infra` (infra/).
"""

__version__ = "0.1.0"
