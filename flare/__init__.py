"""Flare: always-on diagnosis of distributed LLM training.

The house folders are installed under this namespace: `schemas` (schemas/),
`detectors` (detectors/), `producers` (producers/), `streams` (streams/),
`api` (api/) and `infra` (infra/).
"""

__version__ = "0.1.0"
